"""Imported first by the forkserver (startup.PRELOAD): it dies with the launcher that started it,
and only then.

Its workers die with it in turn (worker.spawn_entry, worker.elastic_entry), so killing the
launcher, even with SIGKILL, leaves nothing behind. Without this the forkserver would outlive it:
multiprocessing keeps it running while any worker it forked is alive, and the workers wait on it.
(A launcher that died before this line ran has no workers yet: the forkserver then ends by
itself, on reading the end of its pipe from the launcher.)

The pre-emption signals are ignored here: sent to the whole process group (Slurm's scancel, a
`kill -TERM -PGID`), they would otherwise end the forkserver at once, and its workers with it,
before they write their checkpoint (and the launcher would learn only "exit code 255" of them).
The launcher and the workers take them as a stop request; workers set their own handlers.
"""

from hydra_ddp.runtime import processes

processes.guard_forkserver()
