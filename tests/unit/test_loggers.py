"""The loggers on their own: what a resumed run leaves in TensorBoard, read back as TensorBoard reads
it; W&B's mode (the reader of W&B's run file, against W&B's own service: tests/e2e/test_loggers.py)."""

from __future__ import annotations

import time
from pathlib import Path

from hydra_ddp.reporting.loggers import TensorBoard

from support import event_files, scalars


def test_a_resumed_runs_event_file_is_read_last_even_when_the_earlier_one_sorts_after_it(tmp_path: Path):
    # An earlier attempt logged steps 1-30, in a file whose name sorts after the one a restart in
    # the same second would get (its host and pid compare higher as text). The resumed attempt
    # continues after step 20: TensorBoard must show 1-20 from the first file and 21-25 from the new.
    first = TensorBoard(tmp_path, {"run": 1})
    for step in range(1, 31):
        first.metrics({"train/loss": float(step)}, step)
    first.close()
    (made,) = event_files(tmp_path)
    # The next second (a clock tick in between must not make this pass): the same second as the
    # restart below, or one after it, and higher than any name the restart could get in it.
    earlier = made.rename(made.with_name(f"events.out.tfevents.{int(time.time()) + 1:010d}.zzzz.99999999.0"))

    resumed = TensorBoard(tmp_path, {"run": 1}, resume_step=20)
    for step in range(21, 26):
        resumed.metrics({"train/loss": -float(step)}, step)
    resumed.close()

    names = [path.name for path in event_files(tmp_path)]
    assert len(names) == 2 and names[0] == earlier.name, names  # the resumed run's file is the last read
    assert scalars(tmp_path, "train/loss") == [(s, float(s)) for s in range(1, 21)] + [
        (s, -float(s)) for s in range(21, 26)
    ]


def test_wandb_mode_auto_is_offline_without_an_account_and_follows_wandb_mode(tmp_path: Path, monkeypatch):
    from hydra_ddp.reporting.wandb_logger import choose_mode

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
