"""The warm process: it imports what a command and its forkserver import, once, then forks for each
command that asks (command.py) and runs it in the fork; when the fork ends, it sends the command
its exit status.

The fork takes the command's place before anything of the command runs: its standard streams (the
descriptors themselves), environment, working directory, sys.path, arguments, __main__, umask,
CPUs, scheduling and limits (facts.py). It dies with the command: the end of their connection,
which the command never writes to after its request, sends the fork SIGIO, whose default action
ends it (its forkserver and workers die with it, as with any launcher). What a fork cannot take
from the command it refuses, and the command starts cold; a file the warm process imported that
changed on disk since ends it too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, Optional

from hydra_ddp.launch import startup
from hydra_ddp.warm import facts, wire

# train.py's and eval.py's job (cli.run_job): (job, config path, started at, argv), never returns
Entry = Callable[[str, str, float, list[str]], NoReturn]


def main(path: str, entry: Entry) -> None:
    """`hydra-ddp warm serve`, which `hydra-ddp warm start` runs in the background."""
    environ = dict(os.environ)
    _import_everything()
    Server(path, environ, entry).serve()


def _import_everything() -> None:
    """What a command's process and its forkserver import (cli.run_job, startup.PRELOAD's second
    module), out of the collector's reach as they are there."""
    with startup.frozen_imports():
        import hydra  # noqa: F401

        import hydra_ddp.launch.forkserver_imports  # noqa: F401  (torch, torch._dynamo, workers)
        from hydra_ddp.config import schema  # noqa: F401
        from hydra_ddp.launch import command  # noqa: F401


def loaded_files() -> dict[str, int]:
    """Every imported module's file and its modification time: what a fork would run."""
    found = {}
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if file:
            with contextlib.suppress(OSError):
                found[file] = os.stat(file).st_mtime_ns
    return found


def changed(loaded: dict[str, int]) -> Optional[str]:
    """The first of `loaded` that changed on disk since (or is gone), if any."""
    for file, mtime in loaded.items():
        try:
            if os.stat(file).st_mtime_ns != mtime:
                return file
        except OSError:
            return file
    return None


class Server:
    def __init__(self, path: str, environ: dict[str, str], entry: Entry) -> None:
        """`environ`: this process's environment before its imports."""
        self.path, self.entry = path, entry
        self.started, self.served = time.time(), 0
        self.shared = facts.shared()
        self.early = {k: v for k, v in environ.items() if facts.read_early(k)}
        # what the imports set (torch sets TORCHINDUCTOR_CACHE_DIR): a command's imports would too
        self.imports_set = {k: v for k, v in os.environ.items() if environ.get(k) != v}
        self.loaded = loaded_files()
        self.running: dict[int, socket.socket] = {}  # a fork's pid: its command's connection
        self.stopping = False
        self.closing: list[int] = []  # what a fork closes: the server's own descriptors

    def refusal(self, run: wire.Run) -> Optional[str]:
        """Why this command cannot run in a fork of this process; None: it can."""
        why = facts.why_not(run.shared, run.settings, self.shared)
        if why:
            return why
        early = {k: v for k, v in run.env.items() if facts.read_early(k)}
        for name in sorted(set(early) | set(self.early)):
            # what torch's imports set (TORCHINDUCTOR_CACHE_DIR), the command's imports would too
            set_so = name in self.imports_set and early.get(name) in (None, self.imports_set[name])
            if early.get(name) != self.early.get(name) and not set_so:
                return (
                    f"{name} differs from the warm process's, and is read when torch or Python "
                    "starts"
                )
        gone = changed(self.loaded)
        if gone:
            self.stopping = True
            return (
                f"{gone} changed since the warm process imported it; the warm process ends: start "
                "it again (hydra-ddp warm start)"
            )
        return None

    def serve(self) -> None:
        """Fork a command for each request until asked to stop (`stop`, SIGTERM, changed code);
        then take no more, and end once every command it forked has ended and been answered."""
        import select

        listener: Optional[socket.socket] = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        mask = os.umask(0o177)  # the socket: this user's alone
        try:
            listener.bind(self.path)
        finally:
            os.umask(mask)
        listener.listen(64)
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._stop)
        self.closing = [wake_r, wake_w]
        try:
            while listener is not None or self.running:
                if self.stopping and listener is not None:
                    listener.close()
                    listener = None
                    Path(self.path).unlink(missing_ok=True)
                    continue
                waits = [wake_r] + ([listener] if listener is not None else [])
                ready, _, _ = select.select(waits, [], [])
                if wake_r in ready:
                    with contextlib.suppress(BlockingIOError):
                        while os.read(wake_r, 512):
                            pass
                    self._reap()
                if listener is not None and listener in ready:
                    self._answer(listener.accept()[0], listener)
        finally:
            if listener is not None:
                listener.close()
                Path(self.path).unlink(missing_ok=True)

    def _stop(self, signum: int, frame: Any) -> None:
        self.stopping = True

    def _reap(self) -> None:
        while self.running:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if not pid:
                return
            conn = self.running.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):  # the command is gone
                    wire.send(conn, {"status": status})
                conn.close()

    def _answer(self, conn: socket.socket, listener: socket.socket) -> None:
        conn.settimeout(10)  # a command that connects and says nothing holds no other up
        try:
            message, fds = wire.receive(conn, max_fds=3)
        except Exception:  # noqa: BLE001  (what is not a request is answered by nothing)
            message, fds = None, []
        why = None
        if isinstance(message, wire.Run):
            why = self.refusal(message) if len(fds) == 3 else "its standard streams did not arrive"
        if not isinstance(message, wire.Run) or why:
            for fd in fds:
                os.close(fd)
            if isinstance(message, wire.Ask):
                self.stopping = self.stopping or message.kind == "stop"
                reply = {"pid": os.getpid(), "served": self.served, "since": self.started}
                self._reply(conn, {**reply, "running": len(self.running)})
            elif why:
                self._reply(conn, {"cold": why})
            conn.close()
            return
        sys.stdout.flush()  # nothing of this process's own output may reach the command's
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                listener.close()
                for other in self.running.values():
                    other.close()
                for fd in self.closing:
                    os.close(fd)
                message.env = {**message.env, **self.imports_set}
                _become(message, fds, conn)
                self.entry(message.job, message.config_path, message.started_at, message.argv)
            except BaseException:  # noqa: BLE001  (a fork never returns into the server's loop)
                import traceback

                traceback.print_exc()
            finally:
                os._exit(1)
        self.served += 1
        for fd in fds:
            os.close(fd)
        self.running[pid] = conn
        # a command gone by now: its fork sees the end of the connection (SIGIO) and ends
        self._reply(conn, {"pid": pid})

    @staticmethod
    def _reply(conn: socket.socket, answer: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):
            wire.send(conn, answer)


def _become(run: wire.Run, fds: list[int], conn: socket.socket) -> None:
    """In the fork: take the command's place."""
    import fcntl
    import io
    import select
    import types

    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # A process group of its own, as the command's is: a signal sent to the run's group (Slurm's
    # scancel, a worker's killpg) reaches the run, never the warm process or another command.
    os.setpgid(0, 0)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    facts.take(run.settings)
    os.chdir(run.cwd)
    os.environ.clear()
    os.environ.update(run.env)
    sys.path[:] = run.path
    sys.argv[:] = run.argv
    # the standard streams over the command's descriptors, buffered as the command's are (as
    # Python makes them: unbuffered, -u or PYTHONUNBUFFERED, writes to the descriptor at once)
    for (name, fd), (encoding, errors, line_buffering, write_through) in zip(
        (("stdin", 0), ("stdout", 1), ("stderr", 2)), run.streams
    ):
        raw = io.FileIO(fd, "rb" if fd == 0 else "wb", closefd=False)
        if fd == 0:
            buffer: Any = io.BufferedReader(raw)
        else:
            buffer = raw if write_through else io.BufferedWriter(raw)
        stream = io.TextIOWrapper(
            buffer,
            encoding=encoding,
            errors=errors,
            newline="\n",
            line_buffering=line_buffering,
            write_through=write_through,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    # __main__ as the command's: its workers import its file (or module) as theirs, as there
    name, file = run.main
    main = types.ModuleType("__main__")
    main.__file__ = file
    main.__builtins__ = __builtins__
    main.__spec__ = None
    if name:
        import importlib.util

        main.__spec__ = importlib.util.find_spec(name)
    sys.modules["__main__"] = main
    # Die with the command: the end of the connection sends this process SIGIO (default: end).
    # Its forkserver does not keep the connection (startup.close_in_forkserver).
    fcntl.fcntl(conn.fileno(), fcntl.F_SETOWN, os.getpid())
    flags = fcntl.fcntl(conn.fileno(), fcntl.F_GETFL)
    fcntl.fcntl(conn.fileno(), fcntl.F_SETFL, flags | os.O_ASYNC)
    if select.select([conn], [], [], 0)[0]:
        os._exit(1)  # already gone
    startup.close_in_forkserver.append(conn.fileno())
    startup.warm_fork, startup.command_pid = True, run.pid
