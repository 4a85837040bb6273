"""Soak: the whole test suite, run after run, beside a CPU hog; per-test failure counts.

    make soak          # 5 runs
    make soak RUNS=3   # the standard kept for a big change: 3 consecutive passes (docs/testing.md)
    python bench/soak.py --runs 3 -- -k faults   # any pytest arguments after --

A test that fails once in twenty runs is a bug: this is how it is found. The report goes to
bench/results/SOAK.md (and the console); the exit status is non-zero when any test failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from tempfile import TemporaryDirectory

import provenance

REPO = Path(__file__).resolve().parents[1]
REPORT = REPO / "bench" / "results" / "SOAK.md"
# each run's per-test seconds and launches (tests/durations.py; `python tests/durations.py DIR`)
DURATIONS = REPO / ".test-results" / "soak"


def hog() -> subprocess.Popen:
    """One process spinning on a core: the suite must not depend on having the machine to itself."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)


def run_suite(
    junit: Path, durations: Path, pytest_args: list[str]
) -> tuple[float, int, dict[str, str], Counter]:
    """(seconds, exit code, {test id: "failed" | "error"}, {"passed": n, "skipped": n}) of one full
    run; its per-test durations and launches in `durations` (tests/durations.py)."""
    started = time.monotonic()
    code = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
            *pytest_args,
        ],
        cwd=REPO,
        env={**os.environ, "HDDP_DURATIONS_DIR": str(durations)},
    ).returncode
    seconds = time.monotonic() - started
    bad: dict[str, str] = {}
    counts: Counter[str] = Counter()
    if junit.exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            test = f"{case.get('classname')}::{case.get('name')}"
            for kind in ("failure", "error"):
                if case.find(kind) is not None:
                    bad[test] = kind
            if test not in bad:
                counts["skipped" if case.find("skipped") is not None else "passed"] += 1
    elif code:
        bad["(the run itself)"] = f"exit {code}, no report"
    return seconds, code, bad, counts


def write_report(
    runs: list, failures: Counter, hogged: bool, pytest_args: list[str], planned: int, commit: str
) -> str:
    passed = sum(1 for _, _, code, bad, _ in runs if not bad and not code)
    lines = [
        "# Soak: the whole suite, run after run",
        "",
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC · commit `{commit}` · "
        f"{len(os.sched_getaffinity(0))} cores · Python {platform.python_version()} · "
        f"{'with one CPU-hogging process beside it' if hogged else 'no CPU hog'} · `bench/soak.py`"
        + (f" · pytest {' '.join(pytest_args)}" if pytest_args else ""),
        "",
        f"**{passed} of {len(runs)} runs passed ({planned} "
        f"planned); {sum(failures.values())} test failure(s).**",
        "",
        # Skipped tests are counted: a soak on a machine without Slurm or Open MPI is not the whole
        # suite.
        "| run | result | minutes | passed | skipped | failed tests |",
        "| ---: | --- | ---: | ---: | ---: | --- |",
        *(
            f"| {i} | {'ok' if not bad and not code else 'failed'} | {s / 60:.1f} "
            f"| {counts['passed']} | {counts['skipped']} | {', '.join(bad)} |"
            for i, s, code, bad, counts in runs
        ),
        "",
    ]
    slowest = _slowest(DURATIONS / f"run{runs[-1][0]}") if runs else []
    if slowest:
        lines += [
            f"The slowest tests of run {runs[-1][0]} (every test's seconds and launches: "
            f"`python tests/durations.py {(DURATIONS / f'run{runs[-1][0]}').relative_to(REPO)}`):",
            "",
            "| test | seconds | launches |",
            "| --- | ---: | ---: |",
            *(f"| `{test}` | {seconds:.1f} | {launches} |" for test, seconds, launches in slowest),
            "",
        ]
    if failures:
        lines += [
            "| test | failures |",
            "| --- | ---: |",
            *(f"| `{test}` | {n} of {len(runs)} |" for test, n in failures.most_common()),
            "",
        ]
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text("\n".join(lines))  # after every run: a soak cut short still leaves its report
    return "\n".join(lines)


def _slowest(folder: Path, count: int = 10) -> list[tuple[str, float, int]]:
    tests = {}
    for record in folder.glob("*.json"):
        if record.name != "summary.json":
            tests.update(json.loads(record.read_text())["tests"])
    return sorted(
        ((test, t["seconds"], t["launches"]) for test, t in tests.items()), key=lambda r: -r[1]
    )[:count]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="full-suite runs (default 5)")
    parser.add_argument("--no-hog", action="store_true", help="without the CPU-hogging process")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args()

    # The commit as the soak starts: its own report, written after each run, would dirty the tree.
    commit = provenance.stamp()
    failures: Counter[str] = Counter()
    runs: list = []
    report = ""
    # A soak stopped with SIGTERM (kill, a CI timeout) still stops its hog: `finally` below runs.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    spinner = None if args.no_hog else hog()
    try:
        with TemporaryDirectory() as tmp:
            for i in range(1, args.runs + 1):
                seconds, code, bad, counts = run_suite(
                    Path(tmp) / f"run{i}.xml", DURATIONS / f"run{i}", args.pytest_args
                )
                # one count per failing test per run (the values say how it failed)
                failures.update(bad.keys())
                runs.append((i, seconds, code, sorted(bad), counts))
                print(
                    f"soak: run {i}/{args.runs}: {'ok' if not bad and not code else 'FAILED'} "
                    f"in {seconds:.0f} s, {counts['passed']} passed, {counts['skipped']} skipped"
                    + (f" ({', '.join(sorted(bad))})" if bad else ""),
                    flush=True,
                )
                report = write_report(
                    runs, failures, spinner is not None, args.pytest_args, args.runs, commit
                )
    finally:
        if spinner:
            spinner.kill()
            spinner.wait()
    print(report)
    return 1 if failures or any(code for _, _, code, _, _ in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
