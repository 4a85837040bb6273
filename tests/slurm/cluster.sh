#!/usr/bin/env bash
# A real one-node Slurm cluster in a folder of its own, on free ports (Debian's slurm-wlm and munge, as root):
#
#   tests/slurm/cluster.sh up DIR     # starts munged, slurmctld, slurmd; prints `export SLURM_CONF=DIR/slurm.conf`
#   tests/slurm/cluster.sh down DIR   # cancels every job, then stops the daemons it started (by PID)
#
# The tests start it once per session (tests/conftest.py: slurm_cluster); by hand:
#   eval "$(tests/slurm/cluster.sh up /tmp/slurm)"; sbatch …; tests/slurm/cluster.sh down /tmp/slurm
set -euo pipefail

usage() { echo "usage: $0 up|down DIR" >&2; exit 2; }
[ $# -eq 2 ] || usage
action=$1
dir=$(realpath -m "$2")

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }

stop_pid() {  # TERM, then KILL after 10 s: only the process whose PID this cluster wrote down
  local file=$1 pid
  [ -f "$file" ] || return 0
  pid=$(cat "$file")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$file"
}

down() {
  export SLURM_CONF=$dir/slurm.conf
  if [ -f "$dir/pids/slurmctld" ] && kill -0 "$(cat "$dir/pids/slurmctld")" 2>/dev/null; then
    # Jobs first: a daemon stopped under a running job leaves its slurmstepd processes behind.
    scancel --full --user=root 2>/dev/null || true
    for _ in $(seq 150); do
      [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break
      sleep 0.1
    done
  fi
  stop_pid "$dir/pids/slurmd"
  stop_pid "$dir/pids/slurmctld"
  stop_pid "$dir/pids/munged"
}

up() {
  for tool in munged mungekey slurmctld slurmd sbatch; do
    command -v "$tool" >/dev/null || { echo "cluster.sh: $tool not found: apt-get install slurmctld slurmd slurm-client munge" >&2; exit 3; }
  done
  [ "$(id -u)" = 0 ] || { echo "cluster.sh: needs root (slurmd and munged run as root here)" >&2; exit 3; }
  mkdir -p "$dir"/{run,state,spool,log,pids}
  # munged refuses a socket whose folder (or any parent) others cannot enter.
  chmod 755 "$dir" "$dir/run"
  mungekey -c -f -k "$dir/munge.key" 2>/dev/null
  local host cpus
  host=$(hostname)
  cpus=$(nproc)
  cat > "$dir/slurm.conf" <<CONF
ClusterName=hddp
SlurmctldHost=$host
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/run/munge.sock
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MailProg=/bin/true
KillWait=5
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
NodeName=$host CPUs=$cpus RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
  export SLURM_CONF=$dir/slurm.conf
  # In the foreground of their own sessions: $! is the daemon itself, and `down` stops exactly it.
  setsid munged --foreground --key-file="$dir/munge.key" --socket="$dir/run/munge.sock" \
    --pid-file="$dir/run/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/run/munge.seed" \
    </dev/null >"$dir/log/munged.out" 2>&1 &
  echo $! > "$dir/pids/munged"
  for _ in $(seq 100); do [ -S "$dir/run/munge.sock" ] && break; sleep 0.05; done
  setsid slurmctld -D -c </dev/null >"$dir/log/slurmctld.out" 2>&1 &
  echo $! > "$dir/pids/slurmctld"
  setsid slurmd -D </dev/null >"$dir/log/slurmd.out" 2>&1 &
  echo $! > "$dir/pids/slurmd"
  for _ in $(seq 300); do
    if [ "$(sinfo -h -o %T 2>/dev/null)" = idle ]; then
      echo "export SLURM_CONF=$dir/slurm.conf"
      return 0
    fi
    for daemon in munged slurmctld slurmd; do
      if ! kill -0 "$(cat "$dir/pids/$daemon")" 2>/dev/null; then
        echo "cluster.sh: $daemon exited at start: $(tail -n 3 "$dir/log/$daemon"* 2>/dev/null | tr '\n' ' ')" >&2
        down
        exit 1
      fi
    done
    sleep 0.1
  done
  echo "cluster.sh: the node did not become idle within 30 s (logs in $dir/log)" >&2
  down
  exit 1
}

case $action in
  up) up ;;
  down) down ;;
  *) usage ;;
esac
