"""A step of one's own end to end (trainer.step): the two-optimizer step of docs/extending.md,
written to a package as the page shows it, on two ranks. With the second optimizer at the configured
rate it trains bit for bit as the plain run; at rate 0 the last layer stays as it started while
the rest learns; at a rate of its own, stopped by a signal and resumed, it ends bit for bit as the
uninterrupted run (its second optimizer's momentum travels in the checkpoint)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from support import (
    ONCE,
    assert_same_run,
    check_ok,
    checkpoint_params,
    finish,
    run_train,
    start_train,
    summary,
    the_pages_module,
    torch_equal,
    with_pythonpath,
)

# scheduler=none: the configured optimizer's rate stays optim=sgd's 0.02, as the second one's does.
# The plain run is the session's reference run of this config (the hooks' plain run too,
# tests/e2e/test_hooks.py).
RUN = ("trainer.epochs=2", "trainer.threads=1", "trainer.log_every=1", "scheduler=none")
HEAD = ("fc2.weight", "fc2.bias")  # MnistCNN's last layer: its last two parameters


def the_pages_step(package: Path) -> Path:
    """docs/extending.md's my_package/steps.py, written under `package` as the page has it."""
    return the_pages_module("docs/extending.md", "steps.py", package, after="## A step of your own")


def step_setting(head_lr: float) -> str:
    return f"trainer.step={{_target_:my_package.steps.TwoOptimizers,head_lr:{head_lr}}}"


@pytest.mark.timeout(400)
def test_the_docs_two_optimizer_step_trains_exactly_and_resumes_bit_for_bit(
    tmp_path: Path, reference_run
):
    env = with_pythonpath(the_pages_step(tmp_path / "user"))
    plain, same = reference_run(*RUN), tmp_path / "same"
    check_ok(run_train(same, *RUN, step_setting(0.02), env=env))
    # Two optimizers at one rate are one optimizer: every step's loss and the weights, to the bit.
    assert_same_run(same, plain, "a second optimizer at the configured rate")

    frozen = tmp_path / "frozen"
    check_ok(run_train(frozen, *RUN, step_setting(0.0), env=env))
    first, last = sorted(
        (frozen / "checkpoints").glob("step-*.pt"), key=lambda p: int(p.stem.split("-")[1])
    )
    after_one, after_two = checkpoint_params(first), checkpoint_params(last)
    for name in after_one:
        # the head at rate 0 keeps its start; everything else moved in the second epoch
        assert torch_equal(after_one[name], after_two[name]) == (name in HEAD), name

    # At a rate of its own, stopped by SIGTERM at rank 0's 9th forward (mid first epoch) and
    # resumed: the uninterrupted run, the second optimizer's momentum restored from the checkpoint.
    split, stopped = tmp_path / "split", tmp_path / "stopped"
    check_ok(run_train(split, *RUN, step_setting(0.05), env=env))
    probe = ("model._target_=probes.signal_at", "+model.of=hydra_ddp.models.MnistCNN", ONCE)
    done = finish(start_train(stopped, *RUN, step_setting(0.05), *probe, "+model.step=9", env=env))
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert 3 <= summary(stopped)["steps"] < summary(split)["history"][0]["step"]  # mid-epoch
    check_ok(run_train(stopped, *RUN, step_setting(0.05), "trainer.resume=auto", env=env))
    assert_same_run(stopped, split, "resumed with a second optimizer")
