"""Imported first by the forkserver (startup.PRELOAD): it dies with the launcher that started it.

Its workers die with it in turn (worker.spawn_entry, worker.elastic_entry), so killing the launcher, even with SIGKILL, leaves
nothing behind. Without this the forkserver would outlive it: multiprocessing keeps it running
while any worker it forked is alive, and the workers wait on it.
(A launcher that died before this line ran has no workers yet: the forkserver then ends by
itself, on reading the end of its pipe from the launcher.)
"""

from hydra_ddp import startup

startup.die_with_parent()
