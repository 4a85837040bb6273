#!/usr/bin/env bash
# The GPU check (issue 5), one prepared script: under 5 minutes on one GPU.
#   bash bench/gpu_check.sh            # with the project's venv or any python that has its dependencies
# Writes OUT/gpu_check.md (OUT defaults to bench/results).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi -L
"$PY" -c 'import torch; assert torch.cuda.is_available(), "no CUDA GPU visible"; print("torch", torch.__version__)'
exec "$PY" bench/gpu_check.py
