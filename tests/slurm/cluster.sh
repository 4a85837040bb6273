#!/usr/bin/env bash
# A real Slurm cluster of one or two nodes in a folder of its own, on free ports (Debian's slurm-wlm and munge, as root):
#
#   tests/slurm/cluster.sh up DIR     # starts munged, slurmctld, slurmd; prints `export SLURM_CONF=DIR/slurm.conf`
#   tests/slurm/cluster.sh up DIR 2   # two nodes, hddp-TAG-n1 and -n2 (TAG: 4 random hex digits, so
#                                     # that two clusters can run at once): a slurmd each in the network
#                                     # namespace of that name, on a bridge (10.99.X.11 and .12 on the
#                                     # first subnet no interface holds, interface hddp0; the names in
#                                     # /etc/hosts while it runs); also prints GLOO_SOCKET_IFNAME
#   tests/slurm/cluster.sh down DIR   # cancels every job, stops the daemons it started (by PID),
#                                     # removes the namespaces, bridge and host names it made
#
# Where slurmdbd and mariadb-server are installed it keeps job accounting too (a private mariadbd
# and a slurmdbd in the same folder), so that `sacct`, and submitit through it, see a job that was
# cancelled or timed out; it then prints `export HDDP_SLURM_ACCOUNTING=1`.
#
# A two-node cluster killed before `down` (its session ended under it) leaves its bridge, namespaces
# and host names behind, and they would take the next cluster's routes and names: `up` removes those
# of any cluster whose daemons are all gone, and says so.
#
# The tests start it once per session (tests/conftest.py: slurm_cluster); by hand:
#   eval "$(tests/slurm/cluster.sh up /tmp/slurm)"; sbatch …; tests/slurm/cluster.sh down /tmp/slurm
set -euo pipefail

usage() { echo "usage: $0 up DIR [1|2] | down DIR" >&2; exit 2; }
[ $# -ge 2 ] || usage
action=$1
dir=$(realpath -m "$2")
nodes=${3:-1}
SUBNET=  # the two nodes' 10.99.X, chosen by free_subnet
tag=     # the two nodes' names: hddp-$tag-n1 and -n2

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }

stop_pids() {  # TERM to each at once (each takes 1-2 s to exit), KILL what is left after 10 s: only
  local files=("$@") pids=() file pid  # the processes whose PIDs this cluster wrote down
  for file in "${files[@]}"; do
    [ -f "$file" ] || continue
    pid=$(cat "$file")
    kill -TERM "$pid" 2>/dev/null && pids+=("$pid")
  done
  for _ in $(seq 200); do
    local alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 0.05
  done
  for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
  rm -f "${files[@]}"
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
  stop_pids "$dir"/pids/slurm*  # the daemons, then the database and munge, which they use to the end
  stop_pids "$dir/pids/mariadbd" "$dir/pids/munged"
  if [ -f "$dir/net" ]; then
    remove_network "$(cat "$dir/net")"
    rm -f "$dir/net"
  fi
}

remove_network() {  # a two-node network by its tag: veth pairs, namespaces, bridge, host names
  local tag=$1 i
  for i in 1 2; do
    ip link del "hddpv$tag$i" 2>/dev/null || true  # the pair's other end goes with it
    ip netns del "hddp-$tag-n$i" 2>/dev/null || true
  done
  ip link del "hddpbr$tag" 2>/dev/null || true
  sed -i "/# hddp-slurm $tag\( .*\)\?\$/d" /etc/hosts
}

remove_stale_networks() {  # those of clusters whose daemons are all gone (their folder is on the hosts line)
  local tags tag owner alive pidfile
  tags=$( { ip -o link show type bridge 2>/dev/null | sed -n 's/^[0-9]*: hddpbr\([0-9a-f]*\)[:@].*/\1/p'
            ip netns list 2>/dev/null | sed -n 's/^hddp-\([0-9a-f]*\)-n[12]\b.*/\1/p'
            sed -n 's/.*# hddp-slurm \([0-9a-f]*\).*/\1/p' /etc/hosts; } | sort -u)
  for tag in $tags; do
    owner=$(sed -n "s/.*# hddp-slurm $tag \(.*\)\$/\1/p" /etc/hosts | head -n 1)
    alive=0
    if [ -n "$owner" ]; then
      for pidfile in "$owner"/pids/*; do
        [ -f "$pidfile" ] && case $(ps -o stat= -p "$(cat "$pidfile")" 2>/dev/null) in ""|Z*) ;; *) alive=1 ;; esac
      done
    fi
    [ "$alive" = 1 ] && continue
    echo "cluster.sh: removed the network left by a cluster that is gone (tag $tag${owner:+, $owner})" >&2
    remove_network "$tag"
  done
}

free_subnet() {  # the first 10.99.X/24 that no interface here holds an address in
  local x
  for x in $(seq 0 254); do
    ip -4 -o addr show 2>/dev/null | grep -q " 10\.99\.$x\." || { echo "10.99.$x"; return 0; }
  done
  echo "cluster.sh: every 10.99.X/24 subnet is in use here" >&2
  return 1
}

network() {  # two namespaces on a bridge in this one, the controller at .1
  echo "$tag" > "$dir/net"
  ip link add "hddpbr$tag" type bridge || return 1
  ip addr add "$SUBNET.1/24" dev "hddpbr$tag" || return 1
  ip link set "hddpbr$tag" up || return 1
  for i in 1 2; do
    ip netns add "hddp-$tag-n$i" || return 1
    ip link add "hddpv$tag$i" type veth peer name hddp0 netns "hddp-$tag-n$i" || return 1
    ip link set "hddpv$tag$i" master "hddpbr$tag" up || return 1
    ip -n "hddp-$tag-n$i" addr add "$SUBNET.1$i/24" dev hddp0 || return 1
    ip -n "hddp-$tag-n$i" link set hddp0 up || return 1
    ip -n "hddp-$tag-n$i" link set lo up || return 1
    echo "$SUBNET.1$i hddp-$tag-n$i # hddp-slurm $tag $dir" >> /etc/hosts  # the workers meet at the first node's name
  done
}

accounting_up() {  # a private MariaDB on loopback, then slurmdbd on it; the controller registers itself
  mariadb-install-db --no-defaults --user=root --datadir="$dir/db" --auth-root-authentication-method=normal \
    --skip-test-db --skip-name-resolve >"$dir/log/mariadb-install.log" 2>&1 \
    || { echo "cluster.sh: mariadb-install-db failed (log in $dir/log)" >&2; return 1; }
  # A throwaway database: no flush at each commit, no doublewrite, no binary log.
  setsid mariadbd --no-defaults --user=root --datadir="$dir/db" --port="$db_port" --bind-address=127.0.0.1 \
    --socket="$dir/run/mariadb.sock" --pid-file="$dir/run/mariadb.pid" --skip-name-resolve --skip-log-bin \
    --innodb-flush-log-at-trx-commit=0 --innodb-doublewrite=0 --innodb-buffer-pool-size=64M \
    </dev/null >"$dir/log/mariadbd.out" 2>&1 &
  echo $! > "$dir/pids/mariadbd"
  for _ in $(seq 300); do [ -S "$dir/run/mariadb.sock" ] && break; sleep 0.05; done
  [ -S "$dir/run/mariadb.sock" ] || { echo "cluster.sh: mariadbd did not start (log in $dir/log)" >&2; return 1; }
  # slurmdbd reads slurmdbd.conf beside $SLURM_CONF and refuses one that others can read.
  (umask 077; cat > "$dir/slurmdbd.conf" <<CONF
AuthType=auth/munge
AuthInfo=socket=$dir/run/munge.sock
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$dbd_port
SlurmUser=root
PidFile=$dir/run/slurmdbd.pid
LogFile=$dir/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$db_port
StorageUser=root
StorageLoc=slurm_acct_db
CONF
  )
  setsid slurmdbd -D </dev/null >"$dir/log/slurmdbd.out" 2>&1 &
  echo $! > "$dir/pids/slurmdbd"
  for _ in $(seq 300); do
    grep -q "slurmdbd version .* started" "$dir/log/slurmdbd.log" 2>/dev/null && return 0
    kill -0 "$(cat "$dir/pids/slurmdbd")" 2>/dev/null || break
    sleep 0.1
  done
  echo "cluster.sh: slurmdbd did not start: $(tail -n 3 "$dir/log/slurmdbd.log" 2>/dev/null | tr '\n' ' ')" >&2
  return 1
}

up() {
  for tool in munged mungekey slurmctld slurmd sbatch; do
    command -v "$tool" >/dev/null || { echo "cluster.sh: $tool not found: apt-get install slurmctld slurmd slurm-client munge" >&2; exit 3; }
  done
  [ "$(id -u)" = 0 ] || { echo "cluster.sh: needs root (slurmd and munged run as root here)" >&2; exit 3; }
  local accounting=0
  command -v slurmdbd >/dev/null && command -v mariadbd >/dev/null && command -v mariadb-install-db >/dev/null \
    && accounting=1
  case $nodes in 1|2) ;; *) usage ;; esac
  if [ "$nodes" = 2 ]; then
    command -v ip >/dev/null && command -v nsenter >/dev/null \
      || { echo "cluster.sh: two nodes need iproute2's ip and util-linux's nsenter" >&2; exit 3; }
  fi
  mkdir -p "$dir"/{run,state,spool,log,pids}
  if [ "$nodes" = 2 ]; then
    remove_stale_networks
    SUBNET=$(free_subnet) || exit 3
    tag=$(od -An -N2 -tx1 /dev/urandom | tr -d ' \n')  # names this cluster's nodes, namespaces and links
  fi
  # munged refuses a socket whose folder (or any parent) others cannot enter.
  chmod 755 "$dir" "$dir/run"
  mungekey -c -f -k "$dir/munge.key" 2>/dev/null
  local host cpus dbd_port db_port
  host=$(hostname)
  cpus=$(nproc)
  dbd_port=$(free_port)
  db_port=$(free_port)
  cat > "$dir/slurm.conf" <<CONF
ClusterName=hddp
SlurmctldHost=$host$([ "$nodes" = 2 ] && echo "($SUBNET.1)")
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: how long a node refuses a requeued job after its previous run, and so its requeue
# hold (default 120 s; 5 is the least)
AuthInfo=socket=$dir/run/munge.sock,cred_expire=5
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
$(if [ "$accounting" = 1 ]; then
    echo "AccountingStorageType=accounting_storage/slurmdbd"
    echo "AccountingStorageHost=localhost"
    echo "AccountingStoragePort=$dbd_port"
    echo "AccountingStoragePass=$dir/run/munge.sock"  # which munged signs the messages to slurmdbd
  else
    echo "AccountingStorageType=accounting_storage/none"
  fi)
# The scheduling passes every second, not every 30 and 60: a requeued job starts as soon as its hold ends.
SchedulerParameters=bf_interval=1,sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MailProg=/bin/true
KillWait=5
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
$(if [ "$nodes" = 2 ]; then
    for i in 1 2; do echo "NodeName=hddp-$tag-n$i NodeAddr=$SUBNET.1$i CPUs=$cpus RealMemory=1000 State=UNKNOWN"; done
  else
    echo "NodeName=$host CPUs=$cpus RealMemory=1000 State=UNKNOWN"
  fi)
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
  export SLURM_CONF=$dir/slurm.conf
  if [ "$nodes" = 2 ]; then
    network || { echo "cluster.sh: could not make the two nodes' network namespaces" >&2; down; exit 3; }
  fi
  # In the foreground of their own sessions: $! is the daemon itself, and `down` stops exactly it.
  setsid munged --foreground --key-file="$dir/munge.key" --socket="$dir/run/munge.sock" \
    --pid-file="$dir/run/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/run/munge.seed" \
    </dev/null >"$dir/log/munged.out" 2>&1 &
  echo $! > "$dir/pids/munged"
  for _ in $(seq 100); do [ -S "$dir/run/munge.sock" ] && break; sleep 0.05; done
  if [ "$accounting" = 1 ]; then
    accounting_up || { down; exit 1; }
  fi
  setsid slurmctld -D -c </dev/null >"$dir/log/slurmctld.out" 2>&1 &
  echo $! > "$dir/pids/slurmctld"
  if [ "$nodes" = 2 ]; then
    for i in 1 2; do
      setsid nsenter --net="/run/netns/hddp-$tag-n$i" slurmd -D -N "hddp-$tag-n$i" \
        </dev/null >"$dir/log/slurmd-n$i.out" 2>&1 &
      echo $! > "$dir/pids/slurmd-n$i"
    done
  else
    setsid slurmd -D </dev/null >"$dir/log/slurmd.out" 2>&1 &
    echo $! > "$dir/pids/slurmd"
  fi
  for _ in $(seq 300); do
    if [ "$(sinfo -h -o %T 2>/dev/null | sort -u)" = idle ] && [ "$(sinfo -h -N -o %N | wc -l)" = "$nodes" ]; then
      echo "export SLURM_CONF=$dir/slurm.conf"
      [ "$accounting" = 1 ] && echo "export HDDP_SLURM_ACCOUNTING=1"
      [ "$nodes" = 2 ] && echo "export GLOO_SOCKET_IFNAME=hddp0"
      return 0
    fi
    for pidfile in "$dir"/pids/*; do
      daemon=$(basename "$pidfile")
      if ! kill -0 "$(cat "$pidfile")" 2>/dev/null; then
        echo "cluster.sh: $daemon exited at start: $(tail -n 3 "$dir/log/$daemon"* 2>/dev/null | tr '\n' ' ')" >&2
        down
        exit 1
      fi
    done
    sleep 0.1
  done
  {
    echo "cluster.sh: the node did not become idle within 30 s (logs in $dir/log); sinfo:"
    sinfo -h -N -o '  %N %T %E' 2>&1
    for log in "$dir"/log/slurmd*.log "$dir"/log/slurmctld.log; do
      [ -f "$log" ] && echo "  $(basename "$log"): $(grep -E 'error|fatal' "$log" | grep -v -E 'pmix|PMIx|MPI:|state file|Trying backup' | tail -n 2 | tr '\n' ' ')"
    done
  } >&2
  down
  exit 1
}

case $action in
  up) up ;;
  down) down ;;
  *) usage ;;
esac
