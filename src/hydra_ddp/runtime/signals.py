"""The signals that ask a run to stop: the launcher passes them on to the workers, which note
them."""

import signal

# Pre-emption (SIGTERM; Slurm's SIGUSR1, submitit's SIGUSR2) or Ctrl-C.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
