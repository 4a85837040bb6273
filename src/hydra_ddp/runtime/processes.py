"""A process and its kin: the parent it dies with, and what Linux's /proc says of a process. No
torch here: the forkserver's guard asks before anything heavy is imported."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Optional


def proc_stat(pid: int) -> Optional[list[str]]:
    """/proc/PID/stat's fields after the command's name (which may hold spaces and parentheses):
    [state, parent pid, ...]; None when the process is gone or not visible (or not Linux)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields


def die_with_parent(expected_parent: int | None = None) -> None:
    """SIGKILL this process when its parent dies (even by SIGKILL, with no chance to clean up).

    `expected_parent`: when given and no longer the parent, it died before this took effect."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)


def guard_forkserver(launcher: int | None = None) -> None:
    """A forkserver's guard (launch/forkserver_guard.py says why): it dies with its launcher
    (`launcher`: the pid it must still have as its parent), and ignores the stop signals sent to
    the whole process group, which its workers take."""
    die_with_parent(launcher)
    for stop in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(stop, signal.SIG_IGN)
