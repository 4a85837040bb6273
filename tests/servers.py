"""The tests' servers: TensorBoard, MLflow and an S3 endpoint (moto) started from the project's
venv on loopback, read through their HTTP APIs, looked at with headless Chromium, and always
stopped (the whole process group, even when the test fails), leaving no process or port behind."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

from support import assert_no_orphans, free_port

BIN = Path(sys.executable).parent  # the venv's console scripts: tensorboard, mlflow
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# in a server's and a browser's environment: the pytest process's pid (conftest checks)
MARK = "HDDP_TEST_SERVER"
READY_S = 90  # a server's start on a busy 2-core machine (mlflow's imports, tensorboard's plugins)


def get(url: str, body: Optional[dict] = None, timeout: float = 30) -> Any:
    """JSON from a GET (or, with a body, a POST of JSON)."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json"} if data else {}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def _port_free(port: int) -> bool:
    """No one listens there (connections the server closed may linger in TIME_WAIT: not a
    listener)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@contextlib.contextmanager
def serve(
    argv: list[str],
    ready_path: str,
    log: Path,
    cwd: Optional[Path] = None,
    tries: int = 3,
    env: Optional[dict] = None,
) -> Iterator[str]:
    """Start `argv` ({port} in it and in `env`'s values: a free port), in its own session; yield its
    base URL once `ready_path` answers 200. A port taken between the choice and the bind: another
    port."""
    for attempt in range(tries):
        port = free_port()
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [a.replace("{port}", str(port)) for a in argv],
                stdout=out,
                cwd=cwd,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={
                    **os.environ,
                    **{k: v.replace("{port}", str(port)) for k, v in (env or {}).items()},
                    "NO_PROXY": "*",
                    MARK: str(os.getpid()),
                },
            )
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + READY_S
            while proc.poll() is None and not _answers(base + ready_path):
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"{argv[0]} did not answer {ready_path} in "
                        f"{READY_S} s: {log.read_text()[-3000:]}"
                    )
                time.sleep(0.2)
            if proc.poll() is not None:
                text = log.read_text()
                if "in use" in text.lower() and attempt + 1 < tries:
                    continue  # the port was taken meanwhile
                raise AssertionError(
                    f"{argv[0]} exited ({proc.returncode}) before serving: {text[-3000:]}"
                )
            yield base
            return
        finally:
            stop(proc)
            assert _port_free(port), f"port {port} still bound after {argv[0]} stopped"
    raise AssertionError(f"{argv[0]} found no free port in {tries} tries")


def stop(proc: subprocess.Popen) -> None:
    """The server's whole session: SIGTERM, then SIGKILL after 10 s; nothing may outlive it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError):  # its workers, if the leader went first
        os.killpg(proc.pid, signal.SIGKILL)
    assert_no_orphans(proc.pid)


def tensorboard(logdir: Path, log: Path) -> contextlib.AbstractContextManager[str]:
    # --load_fast=false: TensorBoard's own Python reader, no data-server binary; loopback only.
    return serve(
        [
            str(BIN / "tensorboard"),
            "--logdir",
            str(logdir),
            "--host",
            "127.0.0.1",
            "--port",
            "{port}",
            "--load_fast=false",
            "--reload_interval=0",
        ],
        "/data/runs",
        log,
    )


def mlflow_ui(
    cwd: Path, store_uri: str, log: Path, viewed_at: str = ""
) -> contextlib.AbstractContextManager[str]:
    """`mlflow ui --backend-store-uri STORE` as the docs give it (with a port), from `cwd`;
    viewed_at: another address of this host that a browser may open it at (MLflow's CORS check
    allows it)."""
    origins = (
        {"MLFLOW_SERVER_CORS_ALLOWED_ORIGINS": f"http://{viewed_at}:{{port}}"} if viewed_at else {}
    )
    return serve(
        [
            str(BIN / "mlflow"),
            "ui",
            "--backend-store-uri",
            store_uri,
            "--host",
            "127.0.0.1",
            "--port",
            "{port}",
            "--workers",
            "1",
        ],
        "/health",
        log,
        cwd=cwd,
        env=origins,
    )


def drawn_line_span(
    png: Path, colour: tuple[int, int, int], below: int = 80, tolerance: int = 12
) -> int:
    """The widest run of adjacent pixel columns, under the page's top bar, that hold the colour: a
    curve drawn across a chart spans hundreds; dots, icons and text a few."""
    from PIL import Image

    image = Image.open(png).convert("RGB")
    pixels, (width, height) = image.load(), image.size
    columns = [
        any(
            all(abs(c - k) <= tolerance for c, k in zip(pixels[x, y], colour))
            for y in range(below, height)
        )
        for x in range(width)
    ]
    best = run = 0
    for hit in columns:
        run = run + 1 if hit else 0
        best = max(best, run)
    return best


def browse(url: str, screenshot: Path, wait_ms: int = 15000, size: str = "1400,1000") -> str:
    """What a person sees: headless Chromium renders the page (its scripts run for up to wait_ms of
    virtual time), saves a screenshot, and returns the rendered page's text (the DOM after the
    scripts). Each call is its own browser, in its own session, stopped with it."""
    assert CHROMIUM, "Chromium is not installed (apt-get install chromium)"
    import tempfile

    profile = tempfile.mkdtemp(prefix="chromium-")  # a fresh profile each time, removed after
    common = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        "--no-first-run",
        f"--window-size={size}",
        f"--virtual-time-budget={wait_ms}",
        f"--user-data-dir={profile}",
    ]
    pages = []
    for extra in ([f"--screenshot={screenshot}"], ["--dump-dom"]):
        proc = subprocess.Popen(
            [*common, *extra, url],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            text=True,
            env={**os.environ, MARK: str(os.getpid())},
        )
        try:
            out, _ = proc.communicate(timeout=120)
        finally:
            stop(proc)
        assert proc.returncode == 0, f"chromium exited {proc.returncode} on {url}"
        pages.append(out)
    shutil.rmtree(profile, ignore_errors=True)
    assert screenshot.exists() and screenshot.stat().st_size > 10_000, f"no screenshot of {url}"
    return pages[1]


# Credentials the tests give the S3 server's clients: distinctive, so that a test can find any copy
# of them in a run's files (none may be there: docs/storage.md).
S3_KEY_ID = "AKIAHDDPTESTKEY0001"
S3_SECRET = "hddp-test-secret-7f3c9a1e"


@contextlib.contextmanager
def s3(log: Path, buckets: tuple[str, ...] = ("runs",)) -> Iterator[dict[str, str]]:
    """An S3 endpoint on loopback (moto's server mode, a real HTTP server), with `buckets` made;
    yields the variables a client needs (AWS_ENDPOINT_URL and the credentials), as a user's S3
    client gets them."""
    with serve(
        [str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", "{port}"], "/moto-api/", log
    ) as base:
        env = {
            "AWS_ENDPOINT_URL": base,
            "AWS_ACCESS_KEY_ID": S3_KEY_ID,
            "AWS_SECRET_ACCESS_KEY": S3_SECRET,
            "AWS_DEFAULT_REGION": "us-east-1",
            # nothing of the host's own AWS setup
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true",
        }
        client = s3_client(env)
        for bucket in buckets:
            client.create_bucket(Bucket=bucket)
        yield env


def s3_client(env: dict[str, str]):
    """boto3's S3 client for the server whose variables `env` holds (servers.s3's): the tests' own
    look into the bucket, beside the package's."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_DEFAULT_REGION"],
    )


def use_s3(monkeypatch, env: dict[str, str]) -> None:
    """The S3 server's variables in this process (for the package's readers called in-process),
    and no S3 filesystem that fsspec cached before them: its instances are keyed by their
    arguments, not the environment, so one made earlier would keep its old endpoint and keys."""
    import s3fs

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    s3fs.S3FileSystem.clear_instance_cache()
