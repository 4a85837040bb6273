"""Checkpoints in object storage (checkpoint.dir=s3://…, gs://…, az://…): the bucket's side.

An object store has no links, no rename and no directories, only whole objects that appear when
their upload completes. So a checkpoint there is complete when it can be read as one: a
`step-N.pt` object (one PUT, or a multipart upload, is all or nothing), or a `step-N/` prefix
whose `.metadata` index is there (uploaded last, once every rank's shards are). `last` and `best`
are small objects that hold a checkpoint's name, written after it is complete. A writer killed
mid-upload leaves the previous checkpoint and the pointers as they were.

Credentials and endpoints come from the store's own variables and files (AWS_*, AWS_ENDPOINT_URL,
GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_*): the config holds the URL alone.
"""

from __future__ import annotations

import io
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional, TypeVar

T = TypeVar("T")

# The package fsspec needs for each scheme, and this project's extra that installs it.
PACKAGES = {"s3": ("s3fs", "s3"), "gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs")}
PACKAGES.update({scheme: ("adlfs", "azure") for scheme in ("az", "abfs", "abfss")})

# A transient failure (a dropped connection, a 5xx) is tried again after 0.5, 1 and 2 s; one that
# persists is the run's error. A missing object, a refused permission or no credentials persist.
TRIES = 4
BACKOFF_S = 0.5
PERSISTENT = (FileNotFoundError, PermissionError, FileExistsError, ValueError, TypeError)

STEP = re.compile(r"^step-(\d+)(\.pt)?$")
INDEX = ".metadata"  # DCP's index of a sharded checkpoint: uploaded last
LOCK = ".hydra-ddp.lock"  # the run that writes here (launch/holding.py)
QUIET = ("botocore", "aiobotocore", "s3fs", "gcsfs", "adlfs", "azure")


def is_url(where: object) -> bool:
    """Whether a checkpoint setting names object storage (file:// is a local path)."""
    text = str(where)
    return "://" in text and not text.startswith("file://")


def local_path(where: str) -> Path:
    """A local checkpoint setting (a path, or a file:// URL) as an absolute path."""
    text = where[len("file://") :] if where.startswith("file://") else where
    return Path(text).expanduser().resolve()


class Remote(str):
    """A checkpoint in object storage: its URL, with the little of Path's reading that checkpoint
    code uses (`name`; `is_dir()`: a sharded one, a prefix of every rank's shards)."""

    def __new__(cls, url: str, sharded: bool) -> Remote:
        made = super().__new__(cls, url.rstrip("/"))
        made.sharded = sharded
        return made

    @property
    def name(self) -> str:
        return self.rsplit("/", 1)[-1]

    def is_dir(self) -> bool:
        return self.sharded

    def __truediv__(self, part: str) -> str:
        return f"{self}/{part}"


def retried(what: str, action: Callable[[], T]) -> T:
    """`action`, tried again with backoff on a transient failure; one that persists names `what`
    (the URL)."""
    for attempt in range(TRIES):
        try:
            return action()
        except PERSISTENT as e:
            if isinstance(e, OSError):  # the same kind, saying where
                raise type(e)(f"{what}: {str(e).strip() or type(e).__name__}") from e
            raise
        except Exception as e:  # noqa: BLE001  (each client library has its own transient errors)
            if _persists(e) or attempt == TRIES - 1:
                raise OSError(f"{what}: {_reason(e)} (tried {attempt + 1} times)") from e
            time.sleep(BACKOFF_S * 2**attempt)
    raise AssertionError("unreachable")


def _credentials(error: BaseException) -> bool:
    return "Credentials" in type(error).__name__


def _persists(error: BaseException) -> bool:
    """No credentials, or a request the client refuses to send: no retry changes them."""
    return _credentials(error) or type(error).__name__.endswith("ValidationError")


def _reason(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


class Bucket:
    """A checkpoint folder in object storage: its step checkpoints, the pointers, the lock."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.fs, self.root = filesystem(self.url, "checkpoint.dir")

    def at(self, name: str) -> str:
        return f"{self.url}/{name}"

    def _key(self, name: str) -> str:
        return f"{self.root}/{name}"

    # --- objects ------------------------------------------------------------------------------
    def put(self, name: str, payload: Any) -> None:
        self.fs.invalidate_cache(self.root)
        retried(f"writing {self.at(name)}", lambda: self.fs.pipe_file(self._key(name), payload))

    def put_file(self, local: Path, name: str) -> None:
        retried(f"writing {self.at(name)}", lambda: self.fs.put_file(str(local), self._key(name)))

    def create(self, name: str, payload: bytes) -> bool:
        """Write `name` unless it exists: in one request where the store can (S3's conditional
        write), else checked first. Whether this call wrote it."""
        try:
            retried(
                f"writing {self.at(name)}",
                lambda: self.fs.pipe_file(self._key(name), payload, mode="create"),
            )
        except FileExistsError:
            return False
        except (NotImplementedError, TypeError):  # a store without conditional writes
            if self.read_text(name) is not None:
                return False
            self.put(name, payload)
        return True

    def read_text(self, name: str) -> Optional[str]:
        try:
            return self.get(name).decode()
        except FileNotFoundError:
            return None

    def get(self, name: str) -> bytes:
        return retried(f"reading {self.at(name)}", lambda: self.fs.cat_file(self._key(name)))

    def remove(self, name: str) -> None:
        """An object, or a whole prefix (a sharded checkpoint)."""
        key = self._key(name)
        self.fs.invalidate_cache(self.root)
        if retried(f"listing {self.at(name)}", lambda: self.fs.exists(key)):
            retried(f"removing {self.at(name)}", lambda: self.fs.rm(key, recursive=True))

    # --- checkpoints --------------------------------------------------------------------------
    def steps(self) -> list[Remote]:
        """The complete step checkpoints, oldest first: `step-N.pt` objects, and `step-N/`
        prefixes with their index."""
        found = self._listed()
        complete = [
            (int(m.group(1)), Remote(self.at(name), sharded=not m.group(2)))
            for name in found
            if (m := STEP.match(name)) and (m.group(2) or f"{name}/{INDEX}" in found)
        ]
        return [location for _, location in sorted(complete)]

    def incomplete(self) -> list[str]:
        """Step prefixes without their index: what a writer killed mid-upload left."""
        found = self._listed()
        return [
            name
            for name in found
            if (m := STEP.match(name)) and not m.group(2) and f"{name}/{INDEX}" not in found
        ]

    def _listed(self) -> set[str]:
        """Every name under the folder two levels down (a step prefix and its files)."""
        self.fs.invalidate_cache(self.root)
        try:
            keys = retried(
                f"listing {self.url}", lambda: self.fs.find(self.root, maxdepth=2, withdirs=True)
            )
        except FileNotFoundError:
            return set()
        start = len(self.root) + 1
        return {key[start:] for key in keys if key.startswith(self.root + "/")}

    def pointed(self, which: str) -> Optional[Remote]:
        """The checkpoint that `last` or `best` names, where it is complete."""
        name = self.read_text(which)
        if name is None:
            return None
        return next((s for s in self.steps() if s.name == name.strip()), None)

    def point(self, which: str, location: Remote) -> None:
        self.put(which, f"{location.name}\n".encode())

    def prune(self, keep: int) -> None:
        """All but the newest `keep` step checkpoints go, but the one `best` names."""
        best = self.read_text("best")
        for old in self.steps()[:-keep]:
            if old.name != (best or "").strip():
                self.remove(old.name)


def filesystem(url: str, key: str) -> tuple[Any, str]:
    """fsspec's filesystem for `url`, and the path in it; one line where its package is missing."""
    import fsspec

    # The clients' INFO lines (where they found the credentials, the endpoint) are not the run's.
    for client in QUIET:
        logging.getLogger(client).setLevel(max(logging.WARNING, logging.getLogger(client).level))
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError:
        scheme = url.split("://", 1)[0]
        package, extra = PACKAGES.get(scheme, (f"the fsspec package for {scheme}://", ""))
        install = f"pip install 'hydra-ddp[{extra}]'" if extra else f"pip install {package}"
        raise ImportError(f"{key}={url} needs {package}: {install}") from None
    except ValueError as e:
        raise ValueError(f"{key}={url}: {e}") from None


def reachable(url: str, key: str) -> Optional[str]:
    """Before launch: why `url` cannot hold checkpoints (no package, no bucket, no credentials, no
    endpoint), in one line; None where it can."""
    try:
        fs, root = filesystem(url, key)
    except (ImportError, ValueError) as e:
        return str(e)
    bucket = root.split("/", 1)[0]
    try:
        retried(f"{key}={url}", lambda: fs.ls(bucket, detail=False))
    except FileNotFoundError:
        return f"{key}={url}: the bucket {bucket!r} does not exist; create it, or name another"
    except PermissionError as e:
        return f"{key}={url}: access to {bucket!r} is refused ({_reason(e)}); check the credentials"
    except OSError as e:
        cause = e.__cause__
        if cause is not None and _credentials(cause):
            return (
                f"{key}={url}: no credentials for the store ({_reason(cause)}); set them in its "
                "own variables or files (docs/storage.md), never in the config"
            )
        return f"{key}={url}: the store cannot be reached ({e})"
    return None


# --- reading ---------------------------------------------------------------------------------
def located(where: str) -> Remote:
    """A checkpoint URL as a location: a `.pt` object, or a prefix with its index (sharded)."""
    fs, root = filesystem(where, "ckpt")
    root = root.rstrip("/")
    sharded = retried(f"reading {where}", lambda: fs.exists(f"{root}/{INDEX}"))
    return Remote(where, sharded=sharded)


def load_bytes(location: Remote, name: Optional[str] = None) -> io.BytesIO:
    """A whole-file checkpoint (or one object of a sharded one: `name`), in memory."""
    fs, root = filesystem(location, "ckpt")
    key = f"{root.rstrip('/')}/{name}" if name else root
    where = f"{location}/{name}" if name else str(location)
    return io.BytesIO(retried(f"reading {where}", lambda: fs.cat_file(key)))
