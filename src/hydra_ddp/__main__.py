"""`python -m hydra_ddp COMMAND`: the hydra-ddp command (cli.py)."""

import sys

from hydra_ddp import cli

sys.exit(cli.main())
