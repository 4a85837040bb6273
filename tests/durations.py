"""Where the suite's time goes, kept: a pytest plugin (tests/conftest.py loads it) and, run as a
script, the summary of a whole `make test`.

A pytest session run with $HDDP_DURATIONS_DIR set (`make test` sets `.test-results/`) writes one
JSON record per layer there, `unit.json` and `e2e.json` (`all.json` for both at once): for every
test its outcome, its seconds (setup + call + teardown) and the number of launches it made. A launch
is a process the test started that runs the project (train.py, eval.py, hydra-ddp, a hydra_ddp
module, a launcher: torchrun, mpirun, sbatch), as Python's audit event `subprocess.Popen` reports
it: a sweep or a pair of nodes counts once, what a launch starts in turn is not counted. Under
pytest-xdist the workers attach their counts to each test's report, and the controller writes the
record.

    python tests/durations.py [DIR]     # both layers' records: the 25 slowest, the totals, and
                                        # DIR/summary.json (commit, CPU model, totals, launches)
    python tests/durations.py DIR --record   # also bench/results/durations_<commit>.json: the
                                             # summary and every test's figures, to keep
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DURATIONS_ENV = "HDDP_DURATIONS_DIR"
SLOWEST = 25
# what runs the project: a command line (or a shell script given to bash -c) naming one of these
_LAUNCH = re.compile(
    r"(?<![\w.-])(?:train|eval)\.py\b|(?:^|[\s/'\"])hydra-ddp(?:$|[\s'\"])"
    r"|\b(?:torchrun|mpirun|sbatch)\b|\bhydra_ddp\.(?:tools|export|cli)\b"
    r"|\btorch\.distributed\.(?:launch|run)\b"
)
_PRINT_WORDS = 'printf "%s\\0" "$@"'
_launches = 0  # in this process, so far


def is_launch(args: object) -> bool:
    words = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args or ())
    line = " ".join(
        os.fsdecode(w) if isinstance(w, (bytes, os.PathLike)) else str(w) for w in words
    )
    # a shell asked to print a command's words (the doc test's expansion of them) runs nothing
    return bool(_LAUNCH.search(line)) and not line.rstrip().endswith(_PRINT_WORDS)


def _audit(event: str, args: tuple) -> None:
    global _launches
    if event == "subprocess.Popen" and is_launch(args[1]):
        _launches += 1


# --- The plugin
# ------------------------------------------------------------------------------------------


def pytest_configure(config) -> None:
    sys.addaudithook(_audit)
    config.pluginmanager.register(_Recorder(config), "hddp-durations")


class _Recorder:
    """Each test's seconds and launches; the controller (or the only process) writes them."""

    def __init__(self, config) -> None:
        self.config = config
        self.tests: dict[str, dict] = {}
        self.started = time.monotonic()
        self.launches_before = 0

    # in the process that runs the test (an xdist worker, or the only one)
    def pytest_runtest_setup(self, item) -> None:
        self.launches_before = _launches

    def pytest_runtest_makereport(self, item, call) -> None:
        if call.when == "teardown":  # before the report is made: it copies user_properties
            item.user_properties.append(("launches", _launches - self.launches_before))

    # in the process that reports (the xdist controller, or the only one)
    def pytest_runtest_logreport(self, report) -> None:
        entry = self.tests.setdefault(
            report.nodeid, {"seconds": 0.0, "outcome": "passed", "launches": 0}
        )
        entry["seconds"] = round(entry["seconds"] + report.duration, 3)
        if report.failed:
            entry["outcome"] = "failed" if report.when == "call" else "error"
        elif report.skipped and entry["outcome"] == "passed":
            entry["outcome"] = "skipped"
        if report.when == "teardown":
            entry["launches"] = dict(report.user_properties).get("launches", 0)

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        config = self.config
        folder = os.environ.get(DURATIONS_ENV)
        if not folder or hasattr(config, "workerinput") or config.option.collectonly:
            return  # not asked for; an xdist worker (the controller writes); nothing ran
        in_tests = sum(t["launches"] for t in self.tests.values())
        workers = getattr(config.option, "numprocesses", None)
        record = {
            "layer": _layer(config),
            "seconds": round(time.monotonic() - self.started, 1),
            "exitstatus": int(exitstatus),
            "workers": workers or 1,
            # the session's own (the every-pair check's background process); a worker's are
            # its tests'
            "launches_outside_tests": 0 if workers else _launches - in_tests,
            "tests": self.tests,
        }
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"{record['layer']}.json").write_text(json.dumps(record, indent=1) + "\n")


def _layer(config) -> str:
    """unit, e2e, or all: from the paths pytest was given."""
    parts = []
    for arg in config.args:
        path = Path(arg.split("::")[0]).resolve()
        parts.append(path.relative_to(REPO).parts if path.is_relative_to(REPO) else ())
    layers = {p[1] for p in parts if len(p) > 1 and p[0] == "tests"} & {"unit", "e2e"}
    return layers.pop() if len(layers) == 1 and all(len(p) > 1 for p in parts) else "all"


# --- The summary of a whole run
# ------------------------------------------------------------------------------------------


def cpu_model() -> str:
    """The host's CPU as the bench results name it: bench/provenance.py's reader, loaded from its
    file (this kit runs as a pytest plugin and a script, with no bench/ on its path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("provenance", REPO / "bench" / "provenance.py")
    provenance = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(provenance)
    return provenance.cpu_model()


def commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"},
        ).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def summarize(folder: Path) -> dict:
    layers = {}
    for path in sorted(folder.glob("*.json")):
        if path.name != "summary.json":
            record = json.loads(path.read_text())
            layers[record["layer"]] = record
    tests = {nodeid: t for r in layers.values() for nodeid, t in r["tests"].items()}
    outcomes: dict[str, int] = {}
    for t in tests.values():
        outcomes[t["outcome"]] = outcomes.get(t["outcome"], 0) + 1
    return {
        "commit": commit(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "layers": {
            name: {
                "seconds": r["seconds"],
                "tests": len(r["tests"]),
                "launches": sum(t["launches"] for t in r["tests"].values())
                + r.get("launches_outside_tests", 0),
                "workers": r["workers"],
            }
            for name, r in layers.items()
        },
        "seconds": round(sum(r["seconds"] for r in layers.values()), 1),
        "tests": len(tests),
        "outcomes": outcomes,
        "launches": sum(t["launches"] for t in tests.values())
        + sum(r.get("launches_outside_tests", 0) for r in layers.values()),
        "slowest": sorted(
            ([nodeid, t["seconds"], t["launches"]] for nodeid, t in tests.items()),
            key=lambda row: -row[1],
        )[:SLOWEST],
    }


def main(argv: list[str]) -> int:
    record = "--record" in argv
    argv = [a for a in argv if a != "--record"]
    folder = Path(argv[0] if argv else os.environ.get(DURATIONS_ENV, REPO / ".test-results"))
    if not any(p.name != "summary.json" for p in folder.glob("*.json")):
        print(f"durations: no record in {folder}", file=sys.stderr)
        return 1
    summary = summarize(folder)
    (folder / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    if record:
        tests = {}
        for path in folder.glob("*.json"):
            if path.name != "summary.json":
                tests.update(json.loads(path.read_text())["tests"])
        kept = REPO / "bench" / "results" / f"durations_{summary['commit']}.json"
        kept.write_text(json.dumps({**summary, "every_test": tests}, indent=1) + "\n")
        print(f"durations: kept in {kept.relative_to(REPO)}")
    print(f"\nthe {SLOWEST} slowest tests (seconds: setup + call + teardown; launches):")
    for nodeid, seconds, launches in summary["slowest"]:
        print(f"  {seconds:7.1f} s  {launches:3d}  {nodeid}")
    per_layer = ", ".join(
        f"{name} {r['tests']} tests in {r['seconds']:.0f} s ({r['launches']} launches)"
        for name, r in summary["layers"].items()
    )
    print(
        f"durations: {per_layer}; {summary['commit']} on {summary['cores']} × {summary['cpu']}; "
        f"every test's in {folder}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
