"""The command's side of a warm start: send the command to the warm process named by
HYDRA_DDP_WARM and wait for its fork, passing on the signals it receives, then end as the fork
ended; or return, and the command starts cold. And `hydra-ddp warm start|stop|status`'s work.

No torch here: train.py's process imports this before anything heavy.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Optional

from hydra_ddp.errors import UserError, say
from hydra_ddp.warm import facts, wire

ENV = "HYDRA_DDP_WARM"
# what the command's process passes on to its fork: a pre-emption, Ctrl-C, a hangup, a quit
FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGHUP,
    signal.SIGQUIT,
)


def run_in_fork(job: str, config_path: str, started_at: float, argv: list[str]) -> None:
    """Run this command in a fork of the warm process at HYDRA_DDP_WARM and end as it ended (never
    returns); return at once to start cold when none is set, none answers, or it refuses."""
    path = os.environ.get(ENV)
    if not path:
        return
    sock = wire.connect(path, timeout=30)
    if sock is None:
        say(f"hydra-ddp: note: no warm process answers at {path} ({ENV}); starting cold")
        return
    with sock:
        try:
            wire.send(sock, _request(job, config_path, started_at, argv), (0, 1, 2))
            answer, _ = wire.receive(sock)
        except OSError as error:
            say(f"hydra-ddp: note: the warm process at {path} did not answer ({error}); cold")
            return
        if answer is None or "cold" in answer:
            why = answer["cold"] if answer else "it closed the connection"
            say(f"hydra-ddp: note: starting cold: {why}")
            return
        fork = answer["pid"]

        def forward(signum: int, frame: Any) -> None:
            try:
                os.kill(fork, signum)
            except ProcessLookupError:
                pass

        for sig in FORWARDED:
            signal.signal(sig, forward)
        sock.settimeout(None)
        outcome, _ = wire.receive(sock)
    sys.stdout.flush()
    sys.stderr.flush()
    if outcome is None:
        say(f"hydra-ddp: error: the warm process at {path} ended during the run: outcome unknown")
        os._exit(1)
    status = outcome["status"]
    if os.WIFSIGNALED(status):  # killed: so is this process, by the same signal
        if os.WTERMSIG(status) not in (signal.SIGKILL, signal.SIGSTOP):  # no handler to reset
            signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status))


def _request(job: str, config_path: str, started_at: float, argv: list[str]) -> wire.Run:
    main = sys.modules["__main__"]
    return wire.Run(
        job=job,
        config_path=config_path,
        started_at=started_at,
        argv=list(argv),
        env=dict(os.environ),
        cwd=os.getcwd(),
        path=list(sys.path),
        main=(
            getattr(getattr(main, "__spec__", None), "name", None),
            getattr(main, "__file__", None),
        ),
        streams=[
            (
                getattr(stream, "encoding", None) or "utf-8",
                getattr(stream, "errors", None) or "strict",
                bool(getattr(stream, "line_buffering", False)),
                bool(getattr(stream, "write_through", False)),
            )
            for stream in (sys.stdin, sys.stdout, sys.stderr)
        ],
        shared=facts.shared(),
        settings=facts.settings(),
        pid=os.getpid(),
    )


# --- hydra-ddp warm start | stop | status
# ------------------------------------------------------------------------------------------


def default_path() -> str:
    """Where a warm process listens unless HYDRA_DDP_WARM says: this user's alone."""
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/hydra-ddp-{os.getuid()}"
    os.makedirs(base, mode=0o700, exist_ok=True)
    return os.path.join(base, "warm.sock")


def ask(path: str, kind: str = "ping", timeout: float = 10) -> Optional[dict[str, Any]]:
    """The warm process's answer (its pid, commands served and running, since when); None when
    none answers at `path`."""
    sock = wire.connect(path, timeout)
    if sock is None:
        return None
    with sock:
        try:
            wire.send(sock, wire.Ask(kind))
            answer, _ = wire.receive(sock)
        except OSError:
            return None
    return answer


def start(path: str, timeout: float = 120) -> dict[str, Any]:
    """Start a warm process in the background (a session of its own, its output in PATH.log) and
    wait until it answers: its answer. One already answering at `path` is kept."""
    import subprocess

    answer = ask(path)
    if answer is not None:
        return answer
    Path(path).unlink(missing_ok=True)  # a socket left by a warm process that was killed
    with open(f"{path}.log", "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hydra_ddp", "warm", "serve"],
            env={**os.environ, ENV: path},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise UserError(
                f"the warm process ended as it started (exit {proc.returncode}): {path}.log"
            )
        answer = ask(path, timeout=5) if Path(path).exists() else None
        if answer is not None:
            return answer
        time.sleep(0.05)
    proc.kill()
    raise UserError(f"the warm process did not answer within {timeout:.0f} s: see {path}.log")


def stop(path: str, timeout: float = 30) -> bool:
    """Ask the warm process at `path` to stop, and wait until it takes no more commands; False when
    none answered. What it runs goes on to its end."""
    if ask(path, "stop") is None:
        return False
    deadline = time.monotonic() + timeout
    while Path(path).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return True
