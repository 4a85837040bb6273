"""hydra-ddp: Hydra-configured DistributedDataParallel training.

The package's layout is its architecture: config/ (schema, resolution, checks), launch/ (the
command and the workers it starts), parallel/ (the process group and how the model is spread),
training/ (the worker: the loop and its collaborators), reporting/ (logs, loggers, reports),
tools/ (tuners); data, models and checkpoints are shared by both sides.
"""
