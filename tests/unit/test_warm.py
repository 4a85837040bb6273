"""The warm start's parts, in process (hydra_ddp.warm): its messages and the descriptors they carry,
what a fork refuses to take from a command, and the command's one-line errors. The warm process
itself, forking real commands: tests/e2e/test_startup.py."""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path

import pytest

from hydra_ddp import cli
from hydra_ddp.warm import command as warm
from hydra_ddp.warm import facts, server, wire


def test_a_message_and_its_descriptors_cross_the_connection_whole():
    left, right = socket.socketpair()
    read_end, write_end = os.pipe()
    # bigger than one read of the connection: the environment of a real command can be
    big = {"kind": "run", "env": {f"K{i}": "v" * 100 for i in range(2000)}}
    with left, right:
        wire.send(left, big, (write_end, write_end, write_end))
        got, fds = wire.receive(right, max_fds=3)
        assert got == big and len(fds) == 3
        os.write(fds[1], b"through the passed descriptor")
        assert os.read(read_end, 100) == b"through the passed descriptor"
        for fd in (*fds, read_end, write_end):
            os.close(fd)
        wire.send(right, {"status": 0})
        assert wire.receive(left) == ({"status": 0}, [])
    ended, other = socket.socketpair()
    other.close()
    assert wire.receive(ended) == (None, [])  # the end of the connection, not a message
    ended.close()


def _run(**env: str) -> wire.Run:
    return wire.Run(
        job="train",
        config_path="conf",
        started_at=0.0,
        argv=["train.py"],
        env={**os.environ, **env},
        cwd=os.getcwd(),
        path=[],
        main=(None, "train.py"),
        streams=[],
        shared=facts.shared(),
        settings=facts.settings(),
        pid=os.getpid(),
    )


def test_a_fork_refuses_what_it_cannot_take_from_the_command(tmp_path: Path):
    warm_process = server.Server(str(tmp_path / "unused.sock"), dict(os.environ), entry=None)
    assert warm_process.refusal(_run()) is None

    def differing(what: str, value) -> str:
        run = _run()
        run.shared = dataclasses.replace(run.shared, **{what: value})
        return warm_process.refusal(run)

    assert "another Python" in differing("interpreter", ("/elsewhere", "/elsewhere/python", "3.x"))
    assert "another copy of hydra_ddp" in differing("package", "/elsewhere/hydra_ddp")
    assert "interpreter's options" in differing("options", ((), ("error",), ()))
    assert "namespace" in differing("namespaces", (("net", "net:[1]"),))
    assert "another cgroup" in differing("cgroup", "0::/elsewhere")
    assert "another user" in differing("ids", (1234, 1234, 1234, 1234, ()))
    # read when torch or Python starts: named; an ordinary variable is the fork's to take
    assert warm_process.refusal(_run(OMP_NUM_THREADS="7")).startswith("OMP_NUM_THREADS differs")
    assert warm_process.refusal(_run(PYTHONPATH="/somewhere", MY_SETTING="x")) is None
    # a file it imported changed since: refused, and the warm process ends
    module = tmp_path / "imported.py"
    module.write_text("x = 1\n")
    warm_process.loaded = {**warm_process.loaded, str(module): module.stat().st_mtime_ns}
    assert warm_process.refusal(_run()) is None and not warm_process.stopping
    os.utime(module, ns=(module.stat().st_atime_ns, module.stat().st_mtime_ns + 10**9))
    assert str(module) in warm_process.refusal(_run()) and warm_process.stopping


def test_only_the_variables_read_at_start_must_match():
    early = [
        "TORCH_LOGS",
        "PYTORCH_CUDA_ALLOC_CONF",
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
        "CUDA_VISIBLE_DEVICES",
        "PYTHONHASHSEED",
        "LC_ALL",
    ]
    late = ["PYTHONPATH", "HYDRA_FULL_ERROR", "HOME", "MASTER_PORT", "WANDB_MODE"]
    assert all(facts.read_early(name) for name in early)
    assert not any(facts.read_early(name) for name in late)


def test_warm_says_what_it_takes_in_one_line(capsys: pytest.CaptureFixture, tmp_path: Path):
    assert cli.main(["warm", "begin"]) == 2
    assert capsys.readouterr().err.strip() == (
        "hydra-ddp: error: hydra-ddp warm takes one of start, stop or status: hydra-ddp warm start"
    )
    os.environ[warm.ENV] = str(tmp_path / "nobody.sock")
    try:
        assert cli.main(["warm", "status"]) == 1
        assert cli.main(["warm", "stop"]) == 1
    finally:
        del os.environ[warm.ENV]
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"hydra-ddp: no warm process answers at {tmp_path / 'nobody.sock'}"] * 2


def test_a_command_with_no_warm_process_starts_cold_saying_so(
    capfd: pytest.CaptureFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv(warm.ENV, str(tmp_path / "nobody.sock"))
    assert warm.run_in_fork("train", "conf", 0.0, ["train.py"]) is None  # returned: start cold
    assert capfd.readouterr().err == (
        f"hydra-ddp: note: no warm process answers at {tmp_path / 'nobody.sock'} "
        f"({warm.ENV}); starting cold\n"
    )
    monkeypatch.delenv(warm.ENV)
    assert warm.run_in_fork("train", "conf", 0.0, ["train.py"]) is None
    assert capfd.readouterr().err == ""


def test_no_module_of_the_package_reads_the_environment_as_it_is_imported():
    """A warm start's fork has the package imported already, by the warm process: a module that
    read a variable at import would give every command the warm process's value (the shared-memory
    segment's folder did: parallel/shared_memory.py now reads it when it makes one)."""
    import ast

    from support import REPO

    found = []
    for path in sorted((REPO / "src" / "hydra_ddp").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if any(
                isinstance(sub, ast.Attribute) and sub.attr in ("environ", "getenv")
                for sub in ast.walk(node)
            ):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, f"read at import: {found}"
