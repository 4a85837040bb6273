"""The end-to-end layer's marker: every test collected under tests/e2e gets `e2e` (registered in
pyproject.toml), so that `-m e2e` and `-m "not e2e"` select a layer whatever paths pytest is given.
The fixtures and hooks both layers use are tests/conftest.py's."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m and -k selection reads the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Collection hooks are not per folder: this one sees every item of the session, tests/unit's
    # too.
    for item in items:
        if HERE in item.path.resolve().parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session", autouse=True)
def warm_process():
    """The layer's launches start in forks of one warm process (`hydra-ddp warm`, docs/startup.md):
    torch, Hydra and the project imported once for the session instead of twice a launch. A test
    marked `cold` runs without it, as a command run without HYDRA_DDP_WARM does (what it asserts of
    processes, signals or start-up is about a cold launch); HDDP_COLD=1 runs the whole layer cold.
    The warm process must end when asked, with nothing of it left."""
    import os
    import tempfile

    from hydra_ddp.warm import command as warm

    if os.environ.get("HDDP_COLD") == "1":
        yield None
        return
    path = str(Path(tempfile.mkdtemp(prefix="hddp-warm-", dir="/tmp")) / "warm.sock")
    answer = warm.start(path)
    os.environ[warm.ENV] = path
    try:
        yield answer
    finally:
        os.environ.pop(warm.ENV, None)
        assert warm.stop(path), "the warm process stopped answering during the session"
        from support import wait_for

        wait_for(
            lambda: not Path(f"/proc/{answer['pid']}").exists() or _zombie(answer["pid"]),
            30,
            "the warm process to end",
        )


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.fixture(autouse=True)
def _cold_when_marked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    if request.node.get_closest_marker("cold"):
        monkeypatch.delenv("HYDRA_DDP_WARM", raising=False)
