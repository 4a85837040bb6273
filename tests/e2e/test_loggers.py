"""The reader of W&B's run file, against a file that W&B's own service (a process of its own) wrote:
records that span blocks read back (the other loggers' checks: tests/unit/test_loggers.py)."""

from __future__ import annotations

from pathlib import Path


def test_wandb_run_file_reads_back_records_that_span_blocks(tmp_path: Path, monkeypatch):
    """The reader of W&B's own run file (LevelDB's log format): a config larger than a 32 KiB
    block comes back whole, and the logged rows in order."""
    import wandb

    from hydra_ddp.trackers import wandb_logger

    monkeypatch.setenv("WANDB_SILENT", "true")
    big = {"notes": "x" * 100_000, "nested": {"lr": 0.5}}
    run = wandb.init(
        project="p",
        id="abcd1234",
        mode="offline",
        dir=str(tmp_path),
        config=big,
        settings=wandb.Settings(console="off", x_disable_stats=True, disable_git=True),
    )
    for step in range(3):
        run.log({"loss": 1.0 / (step + 1)}, step=step)
    run.finish()
    wandb.teardown()  # waits for W&B's service to write the file out (run.finish() does not)
    (path,) = wandb_logger.run_files(tmp_path, "abcd1234")
    configs = [
        r.run.config for r in wandb_logger.records(path) if r.WhichOneof("record_type") == "run"
    ]
    assert {u.key: u.value_json for u in configs[0].update}["notes"] == '"' + "x" * 100_000 + '"'
    assert [(row["_step"], row["loss"]) for row in wandb_logger.history(path)] == [
        (0, 1.0),
        (1, 0.5),
        (2, 1 / 3),
    ]
    assert len(wandb_logger.new_run_id()) == 8
