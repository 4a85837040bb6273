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
