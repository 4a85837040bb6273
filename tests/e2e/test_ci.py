"""The suite's own rules: under CI=true a skipped test fails the run; outside CI it stays a skip."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from support import TESTS

HERE = TESTS  # where the plugin ci_skips.py is: the kit's folder


def pytest_in(folder: Path, ci: str) -> subprocess.CompletedProcess:
    """pytest over `folder`'s tests with the suite's ci_skips plugin, CI set to `ci`."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "ci_skips", "-q", "-rs"]
        + ["-p", "no:cacheprovider", str(folder)],
        cwd=folder,
        env={**os.environ, "CI": ci, "PYTHONPATH": str(HERE)},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("ci, code, outcome", [("true", 1, "1 failed"), ("", 0, "1 skipped")])
def test_a_skip_fails_under_ci_and_stays_a_skip_outside(
    tmp_path: Path, ci: str, code: int, outcome: str
):
    (tmp_path / "test_needs.py").write_text(
        "import pytest\n\ndef test_needs_a_tool():\n"
        "    pytest.skip('mpirun is not installed: apt-get install openmpi-bin')\n"
    )
    proc = pytest_in(tmp_path, ci)
    assert proc.returncode == code, proc.stdout
    assert outcome in proc.stdout and "apt-get install openmpi-bin" in proc.stdout, proc.stdout


@pytest.mark.parametrize("ci, code", [("true", 1), ("", 0)])
def test_a_module_skipped_at_import_fails_under_ci_beside_a_passing_test(
    tmp_path: Path, ci: str, code: int
):
    """pytest.importorskip at a module's top skips the module while it is collected; beside a
    passing test pytest used to exit 0 under CI=true."""
    (tmp_path / "test_passes.py").write_text("def test_passes():\n    assert True\n")
    (tmp_path / "test_needs.py").write_text(
        "import pytest\n\npytest.importorskip('no_such_package_here', reason='pip "
        "install no_such_package_here')\n\ndef test_needs_it():\n    pass\n"
    )
    proc = pytest_in(tmp_path, ci)
    assert proc.returncode == code, proc.stdout
    assert "1 passed" in proc.stdout and "pip install no_such_package_here" in proc.stdout, (
        proc.stdout
    )
