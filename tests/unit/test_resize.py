"""Continuing a run at another world size, in this process: the summary's cause of a resize, and an
elastic worker's share of the global batch (the runs themselves: tests/e2e/test_resize.py)."""

from __future__ import annotations


def test_a_resize_names_its_cause():
    from hydra_ddp.training.state import resize_cause

    assert resize_cause(False, {}) == "resume"
    assert (
        resize_cause(False, {"TORCHELASTIC_RUN_ID": "x", "TORCHELASTIC_RESTART_COUNT": "0"})
        == "resume"
    )
    assert (
        resize_cause(True, {"TORCHELASTIC_RUN_ID": "x", "TORCHELASTIC_RESTART_COUNT": "0"})
        == "rescale"
    )
    assert (
        resize_cause(True, {"TORCHELASTIC_RUN_ID": "x", "TORCHELASTIC_RESTART_COUNT": "1"})
        == "restart"
    )
    assert resize_cause(False, {"SLURM_RESTART_COUNT": "2"}) == "requeue"


def test_an_elastic_worker_keeps_the_global_batch_and_micro_batch_and_changes_the_accumulation():
    from types import SimpleNamespace as Section

    from hydra_ddp.parallel import elastic, strategies

    # The sections it reads, as attributes (a RunConfig's parts): settled at the most nodes.
    cfg = Section(
        launcher=Section(name="torchrun", nnodes=4, min_nodes=1),
        data=Section(global_batch_size=64, batch_size=8),
        trainer=Section(accumulate=1),
        strategy=Section(name="ddp"),
    )
    replicas = strategies.replicas_at(cfg)
    assert elastic.at_world_size(cfg, 8, replicas) is None  # the most nodes: as resolved
    # the same micro-batch of 8, 4 of them
    assert elastic.at_world_size(cfg, 2, replicas) == {"trainer.accumulate": 4}
    fixed = Section(
        launcher=Section(name="torchrun", nnodes=2, min_nodes=2),
        data=Section(global_batch_size=64, batch_size=16),
        trainer=Section(accumulate=1),
        strategy=Section(name="ddp"),
    )
    # not elastic: nothing to settle
    assert elastic.at_world_size(fixed, 4, strategies.replicas_at(fixed)) is None
