"""The exception types that reach the user as a single line instead of a traceback, and the way
such a line is written."""

import os
import sys


class UserError(Exception):
    """Something the user can fix (config, data, environment): says what is wrong and what to do."""

    exit_code = 2


class EveryRankError(UserError):
    """Raised by every rank at the same point, on a decision they share (a diverged loss, a failed
    checkpoint write): the launcher reports it once, as the run's, not as one rank's."""


class WorkerError(UserError):
    """A worker's failure reduced to one line for the parent; the traceback stays in the log
    file."""


# Marks the failure of a rank that lost a peer (which failed first, for its own reason): the
# launcher names the peer's failure when it has both (launch's report).
LOST_A_PEER = "lost a peer: "
# Marks a failure every rank shares (EveryRankError): the launcher names no rank for it.
EVERY_RANK = "every rank: "
PEER_GONE = (
    "connection reset by peer",
    "connection closed by peer",
    "broken pipe",
    "connection refused",
    "communicator was aborted",
    "remote process exited",
)


def install_line(package: str, extra: str) -> str:
    """How to install a package one of hydra-ddp's extras names, wherever hydra-ddp came from (a
    clone, a wheel, a project of your own that depends on it)."""
    return (
        f"pip install {package} (or hydra-ddp's `{extra}` "
        f"extra: pip install -e '.[{extra}]' in its clone)"
    )


def root_cause(error: BaseException) -> BaseException:
    """The exception at the bottom of a chain (Hydra's InstantiationException wraps the one the
    user's class raised)."""
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def first_line(error: BaseException) -> str:
    """An exception as one line: `Type: first line of the message`, or the message alone for ours
    (a UserError already says what is wrong and what to do; its class name would be noise)."""
    text = str(error).strip()
    line = text.splitlines()[0] if text else ""
    return line if isinstance(error, UserError) and line else f"{type(error).__name__}: {line}"


def in_loader_worker(text: str) -> str:
    """The message itself, of an exception raised in a DataLoader worker: torch raises it again in
    the rank as "Caught X in DataLoader worker process N.", then the worker's traceback, ending with
    "module.X: message"."""
    if not text.startswith("Caught ") or "\nOriginal Traceback" not in text:
        return text
    last = text.rstrip().splitlines()[-1]
    name, colon, message = last.partition(": ")
    return message if colon and " " not in name else last


def say(line: str) -> None:
    """One line on stderr in one write: the ranks of an outside launch share the stream, and a line
    written in pieces (print writes the text, then the newline) can land inside another rank's."""
    sys.stderr.flush()
    os.write(sys.stderr.fileno(), f"{line}\n".encode())
