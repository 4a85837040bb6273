"""Where a bench result comes from: the commit it measured, whether the tree differed from it, and
the host's CPU.

A result is kept only from a named commit (docs/performance.md): every script stamps its file with
this, and a dirty tree's result says so. Read-only: git takes no index lock (GIT_OPTIONAL_LOCKS=0),
so a bench may run beside other git work in the same checkout."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def commit(repo: Path = REPO) -> tuple[str, bool]:
    """(HEAD's short hash, whether tracked files other than bench/results/ differ from it);
    ("unknown", True) outside a checkout."""
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=repo, env=env, capture_output=True, text=True, check=True
        ).stdout

    try:
        head = git("rev-parse", "--short", "HEAD").strip()
        # Results written since (a report a bench replaced) are not code: they leave the tree clean.
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results")
        return head, bool(changed.strip())
    except (OSError, subprocess.CalledProcessError):
        return "unknown", True


def stamp(repo: Path = REPO) -> str:
    """The commit as one word: HEAD, or HEAD+changes from a dirty tree."""
    head, dirty = commit(repo)
    return head + ("+changes" if dirty and head != "unknown" else "")


def cpu_model() -> str:
    """The host's CPU model, as /proc/cpuinfo names it (results compare only within one host)."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def header(repo: Path = REPO) -> dict:
    """What every result file opens with: the commit, whether the tree differed from it, when, and
    the host (CPU model and count): figures compare only within one host."""
    import time

    head, dirty = commit(repo)
    return {
        "commit": head,
        "dirty": dirty,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": f"{os.cpu_count()} × {cpu_model()}",
    }
