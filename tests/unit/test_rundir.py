"""A run's directory: a new one per run where the config names it by the second, and an explicit one
held by the live run that writes into it (the runs themselves: tests/e2e/test_run_dirs.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hydra_ddp import rundir
from hydra_ddp.errors import UserError
from hydra_ddp.launch import holding


def test_a_name_already_taken_gets_the_next_free_one_and_the_same_answer_twice(
    tmp_path: Path, monkeypatch
):
    monkeypatch.setattr(rundir, "_CLAIMED", {})
    base = str(tmp_path / "runs" / "2026-12-05" / "21-22-45")
    os.makedirs(base)  # another run's, made in the same second
    os.makedirs(base + "-2")
    got = rundir.claim_new(base)
    assert got == base + "-3" and Path(got).is_dir()
    assert rundir.claim_new(base) == got  # Hydra resolves the run directory more than once
    assert rundir.claimed_instead(Path(got)) == base
    fresh = str(tmp_path / "runs" / "2026-12-05" / "21-22-46")
    assert rundir.claim_new(fresh) == fresh and rundir.claimed_instead(Path(fresh)) is None


def test_a_live_holder_on_this_host_refuses_a_second_run_and_a_gone_one_is_taken_over(
    tmp_path: Path,
):
    # A live holder: another process of this host (this one's parent), named by its pid and start
    # time.
    parent = os.getppid()
    live = {"pid": parent, "host": os.uname().nodename, "started": holding._started(parent)}
    (tmp_path / holding.LOCK).write_text(json.dumps(live))
    with pytest.raises(UserError, match=f"is in use by a live run \\(pid {parent}\\)"):
        with holding.held(tmp_path):
            pass
    assert json.loads((tmp_path / holding.LOCK).read_text()) == live  # refused: nothing touched
    # a pid no process has
    (tmp_path / holding.LOCK).write_text(json.dumps({**live, "pid": 2**22 + 7}))
    # A holder gone (killed without releasing it): taken over, and released.
    with holding.held(tmp_path):
        assert json.loads((tmp_path / holding.LOCK).read_text())["pid"] == os.getpid()
    assert not (tmp_path / holding.LOCK).exists()
    # A reused pid is not its holder: the start time differs.
    (tmp_path / holding.LOCK).write_text(
        json.dumps({"pid": os.getpid(), "host": os.uname().nodename, "started": "1"})
    )
    with holding.held(tmp_path):
        pass
