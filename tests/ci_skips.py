"""A pytest plugin: under CI=true a skipped test is a failure. A skip says something the install
step should have provided is missing (a package, a tool, a privilege): CI must not go green past
it. Outside CI, skips stay skips, each saying what to install."""

from __future__ import annotations

import os

import pytest


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if _in_ci() and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = (
            "skipped under CI=true, which allows no skip "
            f"(the install step must provide it): {reason}"
        )


_modules_skipped: list[str] = []


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A whole module skipped (pytest.importorskip at import). pytest's own reporters have counted
    it as a skip by now: the report stays one, and the exit status below fails the run."""
    if _in_ci() and report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _modules_skipped.append(f"{report.nodeid}: {reason}")


def pytest_terminal_summary(terminalreporter) -> None:
    for line in _modules_skipped:
        terminalreporter.write_line(
            "FAILED (a module skipped under CI=true, which allows "
            f"no skip: the install step must provide it) {line}",
            red=True,
        )


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _modules_skipped and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
