"""trainer.compile=true on a model with blocks (the GPT): each block compiled by inductor (C++
kernels built with g++), under DDP, FSDP with activation checkpointing and tensor parallel, training
as the eager run does within float noise; DDP keeps its shared-memory all-reduce and static graph;
inductor's caches live in the run directory, where a resume finds them (it compiles nothing anew).
What it costs and buys in time: bench/compile.py (docs/performance.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from support import check_ok, losses, run_train, summary

# The packed-documents GPT, 2 ranks of 1 thread, no validation: what bench/compile.py times; a
# constant rate (no warmup, a cosine down to itself), so that a run stopped at 6 steps and resumed
# to 12 follows the 12-step run's schedule.
GPT = (
    "+experiment=documents_gpt",
    "scheduler.warmup_ratio=0",
    "scheduler.min_lr_ratio=1.0",
    "trainer.epochs=100",
    "data.val_fraction=0",
    "trainer.threads=1",
    "trainer.log_every=2",
)
# Inductor's fused kernels sum in another order than eager's: the losses agree within float noise.
# 1e-6 relative is the ceiling the suite holds early steps of a compiled run to (the CNN's in
# test_options.py): float32 sums in another order, over 12 steps, stay far below it.
BOUND = 1e-6


def _files(folder: Path) -> set[Path]:
    return {path.relative_to(folder) for path in folder.rglob("*") if path.is_file()}


@pytest.mark.timeout(300)
def test_compiled_blocks_train_as_eager_under_ddp_and_a_resume_compiles_nothing_anew(
    tmp_path: Path,
):
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    check_ok(run_train(eager, *GPT, "trainer.max_steps=12"))
    check_ok(run_train(compiled, *GPT, "trainer.max_steps=6", "trainer.compile=true"))
    s = summary(compiled)
    assert s["compile"] == "blocks"  # true, for a model that names its blocks
    # The blocks' compile leaves DDP alone: its shared-memory all-reduce and static graph stay on.
    assert (
        s["settings"]["strategy.shared_memory"] is True
        and s["settings"]["strategy.static_graph"] is True
    )
    cache = compiled / "compile_cache"
    built = _files(cache)
    # inductor's C++ kernels
    assert any(path.suffix == ".so" for path in built), sorted(map(str, built))[:20]

    check_ok(
        run_train(
            compiled, *GPT, "trainer.max_steps=12", "trainer.compile=true", "trainer.resume=auto"
        )
    )
    # every graph and kernel found in the run's cache: nothing compiled anew
    assert _files(cache) == built
    assert losses(compiled) == pytest.approx(losses(eager), rel=BOUND)
    assert len(losses(compiled)) == 12


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "strategy",
    [("strategy=fsdp", "strategy.activation_checkpointing=full"), ("strategy=tp",)],
    ids=["fsdp-checkpointed", "tp"],
)
def test_compiled_blocks_train_as_eager_under_the_sharded_strategies(
    tmp_path: Path, strategy: tuple[str, ...]
):
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    check_ok(run_train(eager, *GPT, *strategy, "trainer.max_steps=4"))
    check_ok(run_train(compiled, *GPT, *strategy, "trainer.max_steps=4", "trainer.compile=blocks"))
    assert summary(compiled)["compile"] == "blocks"
    assert losses(compiled) == pytest.approx(losses(eager), rel=BOUND)
    assert len(losses(compiled)) == 4
