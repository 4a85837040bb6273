"""The scaling report's flags: a row whose efficiency measures no scaling says why."""

from __future__ import annotations

from hydra_ddp.sweeps import scaling


def _rows(*jobs: tuple[int, int, int, float]) -> list[dict]:
    rows = [
        {
            "job": job,
            "swept": f"trainer.nproc={world}",
            "status": "ok",
            "world_size": world,
            "global_batch_size": batch,
            "threads_per_rank": 1,
            "samples_per_sec": rate,
        }
        for job, (world, batch, _, rate) in enumerate(jobs)
    ]
    for row, (_, _, threads, _) in zip(rows, jobs):
        row["threads_per_rank"] = threads
    scaling._add_speedup(rows)
    scaling._flag(rows)
    return rows


def test_like_for_like_rows_scaling_below_linear_carry_no_flag():
    rows = _rows((1, 64, 1, 100.0), (2, 64, 1, 190.0), (4, 64, 1, 360.0))
    assert [r["flags"] for r in rows] == [None, None, None]
    assert scaling.warnings(rows) == []


def test_another_global_batch_other_threads_and_more_than_linear_are_each_named():
    # the sweep of issue 73: 1 rank at 2 threads on a busy host, then 2 ranks of twice the batch
    rows = _rows((1, 32, 2, 10.0), (2, 64, 1, 148.0))
    assert rows[0]["flags"] is None
    assert rows[1]["flags"] == (
        "global batch 64, not 32 as job 0's; threads per rank 1, not 2 as job 0's; "
        "efficiency 7.40 > 1.1: not scaling (the base job was slowed, or did other work)"
    )
    assert scaling.warnings(rows)[0].startswith("**The jobs' global batches differ (32, 64)**")


def test_an_efficiency_of_exactly_the_ceiling_is_not_flagged_and_failed_rows_are_left_alone():
    rows = _rows((1, 64, 1, 100.0), (2, 64, 1, 220.0))
    assert rows[1]["efficiency"] == 1.1 and rows[1]["flags"] is None
    failed = {"job": 2, "swept": "trainer.nproc=4", "status": "failed", "world_size": None}
    rows.append(failed)
    scaling._flag(rows)
    assert "flags" not in failed
