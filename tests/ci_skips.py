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
        report.longrepr = f"skipped under CI=true, which allows no skip (the install step must provide it): {reason}"


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if _in_ci() and report.skipped:  # a whole module skipped (pytest.importorskip at import)
        report.outcome = "failed"
