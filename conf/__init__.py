"""The config groups, also shipped as the package hydra_ddp.conf (setup.py): Hydra finds them as
pkg://hydra_ddp.conf in an installed hydra-ddp, and here, as train.py always has, as conf/."""
