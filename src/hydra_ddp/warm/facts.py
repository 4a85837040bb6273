"""What a process is beyond its arguments and environment: what a fork of the warm process must
share with the command it runs (`Shared`: else the command starts cold), and what it takes from the
command before it runs it (`Settings`), which its workers then inherit."""

from __future__ import annotations

import dataclasses
import os
import resource
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

# Read when torch, its libraries or Python start: a fork would not see the command's values.
_READ_AT_IMPORT = ("TORCH", "PYTORCH", "OMP_", "KMP_", "MKL_", "OPENBLAS", "GOTO", "CUDA", "NVIDIA")
_READ_AT_START = (
    "PYTHONHASHSEED",
    "PYTHONUNBUFFERED",
    "PYTHONWARNINGS",
    "PYTHONIOENCODING",
    "PYTHONDONTWRITEBYTECODE",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
)


def read_early(name: str) -> bool:
    """An environment variable read before a command's own code runs (at torch's import, at the
    interpreter's start): the warm process's value is the one its forks live with."""
    return name.startswith(_READ_AT_IMPORT) or name in _READ_AT_START


@dataclass(frozen=True)
class Shared:
    """What a fork has of the warm process and cannot change: the command's must be the same."""

    interpreter: tuple[str, str, str]  # the environment's prefix, the executable, the version
    package: str  # where hydra_ddp was imported from
    options: tuple  # sys.flags, -W, -X
    namespaces: tuple[tuple[str, Optional[str]], ...]
    cgroup: Optional[str]
    ids: tuple  # user and group ids, real and effective; supplementary groups


WHY_NOT_SHARED = {
    "interpreter": "another Python (interpreter or environment) than the warm process's",
    "package": "another copy of hydra_ddp than the warm process imported",
    "options": "the interpreter's options (-X, -W, -O, ...) differ from the warm process's",
    "namespaces": "another namespace (network, mounts, ...) than the warm process's",
    "cgroup": "another cgroup than the warm process's",
    "ids": "another user or group than the warm process's",
}


@dataclass(frozen=True)
class Settings:
    """What a fork takes from the command (its workers inherit them as they would the command's)."""

    umask: int
    cpus: tuple[int, ...]
    policy: int  # the scheduling policy and its priority
    priority: int
    niceness: int
    limits: tuple[tuple[str, tuple[int, int]], ...]  # every RLIMIT_*: (soft, hard)


def shared() -> Shared:
    namespaces = []
    for name in ("net", "mnt", "pid", "ipc", "uts", "user", "cgroup"):
        try:
            namespaces.append((name, os.readlink(f"/proc/self/ns/{name}")))
        except OSError:
            namespaces.append((name, None))
    try:
        cgroup: Optional[str] = Path("/proc/self/cgroup").read_text()
    except OSError:
        cgroup = None
    return Shared(
        interpreter=(os.path.realpath(sys.prefix), os.path.realpath(sys.executable), sys.version),
        package=str(Path(__file__).resolve().parents[1]),
        options=(tuple(sys.flags), tuple(sys.warnoptions), tuple(sorted(sys._xoptions.items()))),
        namespaces=tuple(namespaces),
        cgroup=cgroup,
        ids=(os.getuid(), os.geteuid(), os.getgid(), os.getegid(), tuple(sorted(os.getgroups()))),
    )


def settings() -> Settings:
    mask = os.umask(0)
    os.umask(mask)
    return Settings(
        umask=mask,
        cpus=tuple(sorted(os.sched_getaffinity(0))),
        policy=os.sched_getscheduler(0),
        priority=os.sched_getparam(0).sched_priority,
        niceness=os.getpriority(os.PRIO_PROCESS, 0),
        limits=tuple(
            (name, resource.getrlimit(getattr(resource, name)))
            for name in sorted(dir(resource))
            if name.startswith("RLIMIT_")
        ),
    )


def why_not(theirs: Shared, their_settings: Settings, ours: Shared) -> Optional[str]:
    """Why a fork of this process cannot be the command; None when it can."""
    for field in dataclasses.fields(Shared):
        if getattr(theirs, field.name) != getattr(ours, field.name):
            return WHY_NOT_SHARED[field.name]
    if os.geteuid() == 0:
        return None
    # what only root may raise
    mine = settings()
    if their_settings.niceness < mine.niceness or (
        their_settings.policy != mine.policy and mine.policy == os.SCHED_IDLE
    ):
        return "it runs at a higher priority than the warm process, which a fork cannot"
    own = dict(mine.limits)
    for name, (_, hard) in their_settings.limits:
        limit = own[name][1]
        if limit != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or hard > limit):
            return f"its {name} is above the warm process's, which a fork cannot raise"
    return None


def take(them: Settings) -> None:
    """In the fork: the command's umask, CPUs, scheduling and limits."""
    os.umask(them.umask)
    os.sched_setaffinity(0, them.cpus)
    os.sched_setscheduler(0, them.policy, os.sched_param(them.priority))
    os.setpriority(os.PRIO_PROCESS, 0, them.niceness)
    for name, limits in them.limits:
        if resource.getrlimit(getattr(resource, name)) != tuple(limits):
            resource.setrlimit(getattr(resource, name), tuple(limits))
