"""The loggers on their own: what a resumed run leaves in TensorBoard, read back as TensorBoard
reads it; W&B's mode (the reader of W&B's run file, against W&B's own service:
tests/e2e/test_loggers.py)."""

from __future__ import annotations

import csv
import time
from pathlib import Path

from hydra_ddp.reporting.loggers import CSV, TensorBoard

from support import event_files, scalars


def test_a_resumed_runs_event_file_is_read_last_even_when_the_earlier_one_sorts_after_it(
    tmp_path: Path,
):
    # An earlier attempt logged steps 1-30, in a file whose name sorts after the one a restart in
    # the same second would get (its host and pid compare higher as text). The resumed attempt
    # continues after step 20: TensorBoard must show 1-20 from the first file and 21-25 from the
    # new.
    first = TensorBoard(tmp_path, {"run": 1})
    for step in range(1, 31):
        first.metrics({"train/loss": float(step)}, step)
    first.close()
    (made,) = event_files(tmp_path)
    # The next second (a clock tick in between must not make this pass): the same second as the
    # restart below, or one after it, and higher than any name the restart could get in it.
    earlier = made.rename(
        made.with_name(f"events.out.tfevents.{int(time.time()) + 1:010d}.zzzz.99999999.0")
    )

    resumed = TensorBoard(tmp_path, {"run": 1}, resume_step=20)
    for step in range(21, 26):
        resumed.metrics({"train/loss": -float(step)}, step)
    resumed.close()

    names = [path.name for path in event_files(tmp_path)]
    # the resumed run's file is the last read
    assert len(names) == 2 and names[0] == earlier.name, names
    assert scalars(tmp_path, "train/loss") == [(s, float(s)) for s in range(1, 21)] + [
        (s, -float(s)) for s in range(21, 26)
    ]


def test_wandb_mode_auto_is_offline_without_an_account_and_follows_wandb_mode(
    tmp_path: Path, monkeypatch
):
    from hydra_ddp.trackers.wandb_logger import choose_mode

    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: never logged in
    assert choose_mode("auto") == "offline"
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password k3y\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert choose_mode("auto") == "online"  # `wandb login` wrote it
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")
    assert choose_mode("auto") == "offline"  # logged in elsewhere, not at this server
    monkeypatch.setenv("WANDB_API_KEY", "k3y")
    assert choose_mode("auto") == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert choose_mode("auto") == "disabled" and choose_mode("offline") == "offline"


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_metrics_csv_writes_a_step_once_the_next_begins_and_every_step_on_flush(tmp_path: Path):
    """What a SIGKILL leaves: every step before the newest one in the file as the run goes, and
    after flush() (before each checkpoint) the newest too; a value added to a written row rewrites
    it."""
    log = CSV(tmp_path, config={})
    for step in (1, 2, 3):
        log.metrics({"train/loss": 1.0 / step}, step)
    assert [r["step"] for r in _rows(log.path)] == ["1", "2"]
    log.flush()
    assert [r["step"] for r in _rows(log.path)] == ["1", "2", "3"]
    # the checkpoint's step validated after the flush: a wider row
    log.metrics({"val/loss": 0.5}, 3)
    log.metrics({"test/loss": 0.25}, 3)
    log.flush()
    rows = _rows(log.path)
    assert [r["step"] for r in rows] == ["1", "2", "3"]
    assert rows[-1] == {
        "step": "3",
        "train/loss": str(1.0 / 3),
        "val/loss": "0.5",
        "test/loss": "0.25",
    }
    log.metrics({"train/loss": 0.1}, 4)
    log.close()
    assert [r["step"] for r in _rows(log.path)] == ["1", "2", "3", "4"]


def test_metrics_csv_resumed_keeps_the_rows_up_to_the_checkpoint_and_goes_on(tmp_path: Path):
    log = CSV(tmp_path, config={})
    for step in range(1, 6):
        log.metrics({"train/loss": float(step)}, step)
    log.flush()  # killed at step 5, after a flush; the checkpoint is step 4's
    resumed = CSV(tmp_path, config={}, resume_step=4)
    assert [r["step"] for r in _rows(resumed.path)] == ["1", "2", "3", "4"]
    resumed.metrics({"train/loss": 5.5}, 5)
    resumed.flush()
    assert [(r["step"], r["train/loss"]) for r in _rows(resumed.path)][-2:] == [
        ("4", "4.0"),
        ("5", "5.5"),
    ]
