"""Fixtures and hooks shared by the tests of both layers, tests/unit and tests/e2e (whose own
conftest.py marks its tests `e2e`). The helpers they use (running train.py, reading back a run's
outputs, making data) are in support.py: `from support import ...`."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from support import REPO

pytest_plugins = ["ci_skips", "durations"]  # under CI=true a skip fails; the time kept

PAIR_TEST = (
    "test_every_pair_of_options_passes_the_check_or_fails_in_one_line_and_a_passing_pair_trains"
)


def _idle() -> None:
    # only the CPU time no one else wants
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


# after -m and -k have deselected: only a session that runs the test starts it
@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    """The every-pair check (tests/pair_checks.py: minutes of pure CPU) starts now, in the
    background at the CPU's idle priority, so it runs in the time the suite's runs leave the cores
    idle (waiting for their peers, their timeouts, their daemons) and slows none of them; its test
    (tests/e2e/test_check.py) goes last and reads its results."""
    import sys
    import tempfile

    chosen = [item for item in items if item.name == PAIR_TEST]
    if not chosen or len(items) == 1 or config.option.collectonly:
        return  # alone: the test checks the pairs itself
    items[:] = [item for item in items if item.name != PAIR_TEST] + chosen
    out = Path(tempfile.mkdtemp(prefix="hddp-pairs-")) / "pairs.json"
    with open(out.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "pair_checks.py"), str(out)],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=_idle,
            start_new_session=True,
        )
    config.pair_checks = (proc, out)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """`reference_run(*overrides)`: the default launch (spawn) of a config, made once for the
    session however many tests compare with it (the same overrides in any order: one run). What
    other launchers, pods and nodes must match bit for bit. Readers only read it: a test that
    resumes, exports or evaluates into a run makes its own."""
    from support import check_ok, run_train

    made: dict[tuple[str, ...], Path] = {}

    def run(*overrides: str) -> Path:
        keys = [override.split("=", 1)[0] for override in overrides]
        assert len(set(keys)) == len(keys), f"a key given twice: {overrides}"
        key = tuple(sorted(overrides))
        if key not in made:
            folder = tmp_path_factory.mktemp("reference") / "run"
            check_ok(run_train(folder, *overrides))
            made[key] = folder
        return made[key]

    return run


@pytest.fixture(scope="session")
def spawned(reference_run) -> Path:
    """The default launch (spawn, 2 ranks) of a short run (support.QUICK), made once: what every
    other launcher's run of the same config must match bit for bit (losses and final weights)."""
    from support import QUICK

    return reference_run(*QUICK)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real Slurm cluster for the session (tests/slurm/cluster.sh: munged, slurmctld and a slurmd
    per node on free ports, in a folder of their own): two nodes, hddp-TAG-n1 and -n2, each in a
    network namespace of its own where iproute2 and nsenter exist, else one; with job accounting
    (slurmdbd and a private MariaDB) where those are installed. `.env`: the variables its commands
    and jobs need; `.nodes`: how many; `.accounting`: whether sacct works."""
    import shutil
    import tempfile
    import types

    if os.geteuid() != 0:
        pytest.skip("the Slurm tests start munged and slurmd, which need root")
    missing = [
        tool
        for tool in ("munged", "mungekey", "slurmctld", "slurmd", "sbatch")
        if shutil.which(tool) is None
    ]
    if missing:
        pytest.skip(
            f"Slurm is not installed ({', '.join(missing)} missing): "
            "apt-get install --no-install-recommends slurmctld slurmd slurm-client munge"
        )
    nodes = 2 if shutil.which("ip") and shutil.which("nsenter") else 1
    # munged's socket needs 755 parents
    folder = Path(tempfile.mkdtemp(prefix="hddp-slurm-", dir="/tmp"))
    script = str(REPO / "tests" / "slurm" / "cluster.sh")
    up = subprocess.run(
        [script, "up", str(folder), str(nodes)], capture_output=True, text=True, timeout=90
    )
    try:
        assert up.returncode == 0, f"the Slurm cluster did not start: {up.stderr}"
        # `export NAME=VALUE` lines: SLURM_CONF, and with two nodes the interface gloo must use
        # there.
        env = dict(
            line.removeprefix("export ").split("=", 1)
            for line in up.stdout.split("\n")
            if line.startswith("export ")
        )
        accounting = env.pop("HDDP_SLURM_ACCOUNTING", None) == "1"
        yield types.SimpleNamespace(env=env, nodes=nodes, accounting=accounting)
    finally:
        daemons = (
            [int(f.read_text()) for f in (folder / "pids").glob("*")]
            if (folder / "pids").is_dir()
            else []
        )
        tag = (folder / "net").read_text().strip() if (folder / "net").is_file() else None
        subprocess.run([script, "down", str(folder)], capture_output=True, text=True, timeout=90)
        shutil.rmtree(folder, ignore_errors=True)
        # Nothing of the cluster is left: no daemon it started, no namespace, no host name.
        assert not [pid for pid in daemons if Path(f"/proc/{pid}").exists()], (
            "a Slurm or munge daemon outlived the cluster"
        )
        if tag:
            namespaces = subprocess.run(
                ["ip", "netns", "list"], capture_output=True, text=True, timeout=30
            ).stdout
            assert (
                f"hddp-{tag}-" not in namespaces
                and f"hddp-slurm {tag}" not in Path("/etc/hosts").read_text()
            )


# The servers and browsers the tests start (servers.py marks their environment): none may outlive
# the suite.
def _servers_running() -> dict[int, str]:
    from servers import MARK

    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                environ = Path(f"/proc/{entry}/environ").read_bytes()
                cmdline = (
                    Path(f"/proc/{entry}/cmdline")
                    .read_bytes()
                    .replace(b"\0", b" ")
                    .decode(errors="replace")
                )
            except OSError:
                continue
            if f"{MARK}={os.getpid()}".encode() in environ.split(b"\0"):
                found[int(entry)] = cmdline
    return found


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    background = getattr(session.config, "pair_checks", None)
    if background is not None and background[0].poll() is None:  # the test did not run to its end
        os.killpg(background[0].pid, 9)
        background[0].wait()
    left = _servers_running()
    if left:
        session.exitstatus = 1
        print(f"\nprocesses the tests started are still running after the suite: {left}")
