"""The warm start's messages: a length and a pickle each; the command's first carries its standard
streams as file descriptors (SCM_RIGHTS)."""

from __future__ import annotations

import pickle
import socket
import struct
from dataclasses import dataclass
from typing import Any, Optional

from hydra_ddp.warm import facts

_HEADER = struct.Struct("!I")


def send(sock: socket.socket, message: Any, fds: tuple[int, ...] = ()) -> None:
    data = pickle.dumps(message)
    framed = _HEADER.pack(len(data)) + data
    sent = socket.send_fds(sock, [framed], list(fds)) if fds else 0
    if sent < len(framed):  # (an empty send to a peer that has answered and closed: EPIPE)
        sock.sendall(framed[sent:])


def receive(sock: socket.socket, max_fds: int = 0) -> tuple[Any, list[int]]:
    """A message and the descriptors that came with it; (None, []) at the end of the connection."""
    if max_fds:
        chunk, fds, _, _ = socket.recv_fds(sock, 1 << 16, max_fds)
    else:
        chunk, fds = sock.recv(1 << 16), []
    buffer = bytearray(chunk)
    while chunk:
        if len(buffer) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(buffer)
            if len(buffer) >= _HEADER.size + size:
                return pickle.loads(bytes(buffer[_HEADER.size : _HEADER.size + size])), fds
        chunk = sock.recv(1 << 16)
        buffer += chunk
    return None, fds


def connect(path: str, timeout: Optional[float] = None) -> Optional[socket.socket]:
    """A connection to the warm process at `path`; None when nothing listens there."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        return None
    return sock


@dataclass
class Run:
    """A command, asked to run in a fork: everything the fork takes its place with."""

    job: str  # train or eval
    config_path: str  # where its config groups are
    started_at: float  # the command's start: the run's wall time counts from it
    argv: list[str]
    env: dict[str, str]
    cwd: str
    path: list[str]  # sys.path
    main: tuple[Optional[str], Optional[str]]  # __main__'s module name (python -m), or its file
    streams: list[tuple[str, str, bool, bool]]  # stdin's, stdout's, stderr's text settings
    shared: facts.Shared
    settings: facts.Settings
    pid: int  # the command's process: a run directory's holder (launch/holding.py) is it


@dataclass
class Ask:
    """`ping`: how the warm process stands; `stop`: end, once what it runs has ended."""

    kind: str
