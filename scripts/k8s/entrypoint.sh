#!/bin/sh
# The image's entrypoint (scripts/k8s/Dockerfile), the command of every pod of a TrainJob
# (scripts/k8s/trainjob.yaml) or a PyTorchJob: one train.py per pod, its arguments train.py's
# overrides. No torchrun: train.py reads the pod's PET_* (set by the controller) and starts the
# pod's workers itself, meeting the other pods at node 0's PET_MASTER_ADDR:PET_MASTER_PORT; a
# PyTorchJob pod with only RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT is one worker (docs/kubernetes.md).
set -eu
cd "$(dirname "$0")/../.."  # the project's root (/workspace in the image): train.py and conf/
exec python train.py "$@"
