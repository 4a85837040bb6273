"""hydra-ddp: Hydra-configured DistributedDataParallel training."""

__version__ = "0.1.0"
