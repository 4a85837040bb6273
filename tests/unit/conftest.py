"""The unit layer's rule, enforced: a test here starts no process. A multiprocessing process (a
DataLoader worker, a spawned rank) or a fork fails the test, and so does a subprocess that the
project's code or a test starts; a library's own helper (ctypes running ldconfig as torch imports)
is let through. The failure names where such a test belongs."""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
import sys
import sysconfig
from collections.abc import Iterator

import pytest

REFUSED = "the unit layer starts no process: this test belongs in tests/e2e"
_STDLIB = sysconfig.get_paths()["stdlib"]
_LIBRARIES = tuple(
    p for p in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]} if p
)
_popen = subprocess.Popen.__init__


def _refused(*args, **kwargs):
    raise AssertionError(REFUSED)


def _popen_unless_a_library(self, *args, **kwargs):
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_STDLIB):
        frame = frame.f_back  # subprocess.run, ctypes.util: whoever called them decides
    if frame is None or not frame.f_code.co_filename.startswith(_LIBRARIES):
        raise AssertionError(REFUSED)
    return _popen(self, *args, **kwargs)


@pytest.fixture(autouse=True)
def no_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(subprocess.Popen, "__init__", _popen_unless_a_library)
    monkeypatch.setattr(os, "fork", _refused)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refused)
    yield
