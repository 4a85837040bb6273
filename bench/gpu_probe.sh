#!/usr/bin/env bash
# Where the one-GPU CNN's gap to the hand-written loop goes (bench/results/gpu_check.md, commit f26948d:
# train.py at 0.80x bench/handwritten.py's samples/s on an H200). A diagnostic, not a result: the two
# in turns, train.py with its loader settings and logging varied, and a run five times as long.
#   bash bench/gpu_probe.sh     # on the GPU machine, after bench/gpu_check.sh's set-up; about 2 minutes
# Each line: the side and its overrides, steady samples/s, median step ms, the fast settings chosen.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-bench/results}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
# gpu_check.py's one-GPU CNN and hand-written loop, as its parity case runs them (CNN, ONE_RANK, HAND_CNN).
CASE="import sys; sys.path.insert(0, 'bench'); import gpu_check as g
values = [getattr(g, name) for name in sys.argv[1:]]
print('\\n'.join(a for v in values for a in ([v] if isinstance(v, str) else v)))"
mapfile -t BASE < <("$PY" -c "$CASE" CNN ONE_RANK)
mapfile -t HAND < <("$PY" -c "$CASE" HAND_CNN)
[ ${#BASE[@]} -gt 1 ] && [ ${#HAND[@]} -gt 1 ] || { echo "gpu_probe: cannot read bench/gpu_check.py's cases" >&2; exit 2; }
SHOW="import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], round(d['steady_samples_per_sec']),
    round(d['median_step_time_s'] * 1e3, 3), d.get('settings', ''))"
hand() {
    timeout 60 "$PY" bench/handwritten.py "${HAND[@]}" --nproc=1 --steps="$1" /tmp/probe-hand.json >/dev/null 2>&1 &&
        "$PY" -c "$SHOW" /tmp/probe-hand.json "hand-written steps=$1" | tee -a "$OUT/gpu_probe.txt"
}
project() {
    rm -rf /tmp/probe-run
    timeout 60 "$PY" train.py "${BASE[@]}" "$@" hydra.run.dir=/tmp/probe-run >/dev/null 2>&1 &&
        "$PY" -c "$SHOW" /tmp/probe-run/summary.json "train.py $*" | tee -a "$OUT/gpu_probe.txt"
}
echo "gpu_probe: commit ${BENCH_COMMIT:-unknown}, $(date -u '+%Y-%m-%d %H:%M')" | tee "$OUT/gpu_probe.txt"
hand 200; project trainer.max_steps=200; hand 200; project trainer.max_steps=200
project trainer.max_steps=200 trainer.timing=false
project trainer.max_steps=200 trainer.log_every=1000
project trainer.max_steps=200 trainer.channels_last=false
project trainer.max_steps=200 strategy.static_graph=false strategy.gradient_as_bucket_view=false
hand 1000; project trainer.max_steps=1000
