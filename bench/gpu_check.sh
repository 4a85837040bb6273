#!/usr/bin/env bash
# The GPU check, one prepared script: under 5 minutes on one GPU (bench/gpu_check.py says what it runs).
#   bash bench/gpu_check.sh              # on the GPU machine, with the project's venv or any python with its dependencies
#   bash bench/gpu_check.sh --dry-run    # anywhere: checks every case's config on the CPU, launches nothing
# The full check writes OUT/gpu_check.md and OUT/gpu_check.json after every case (OUT defaults to bench/results).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
# src for the project, tests/helpers for the test models a case injects (faulty.FailOnRank).
export PYTHONPATH="$PWD/src:$PWD/tests/helpers${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [[ " $* " != *" --dry-run "* ]]; then
    nvidia-smi -L || true  # the GPUs as the driver sees them; gpu_check.py asks torch itself
fi
exec "$PY" bench/gpu_check.py "$@"
