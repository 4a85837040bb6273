"""Elastic runs (launcher.nnodes=1:2) on two "nodes" in network namespaces: a node lost mid-epoch,
and a node that joins mid-run. The group re-forms at the new world size, resumes from the last
checkpoint at the sample where it stood, and trains on as an uninterrupted run at that size
would."""

from __future__ import annotations

import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

from support import (
    TwoHosts,
    assert_float64_alike,
    assert_same_params,
    check_ok,
    csv_step_losses,
    final_params,
    finish,
    float64,
    run_train,
    start_train,
    step_losses,
    summary,
    wait_for,
)

pytestmark = [
    pytest.mark.skipif(shutil.which("ip") is None, reason="iproute2's `ip` is not installed"),
    pytest.mark.skipif(os.geteuid() != 0, reason="creating network namespaces needs root"),
]

# The digits, rank 0's reads slowed (5 ms a sample) so that a run lasts long enough to be resized
# mid-run; 2 epochs of 45 steps of a global batch of 32, a checkpoint every 10 steps, all kept.
# float64 (support.py): at another world size only the order of sums differs, decided within
# FLOAT64_BOUND.
DATA = (
    "data.dataset._target_=recording.digits_slow_on_rank",
    "+data.dataset.slow_rank=0",
    "data.global_batch_size=32",
    "trainer.epochs=2",
    "trainer.log_every=1",
    "checkpoint.every_n_steps=10",
    "checkpoint.keep=100",
    *float64(),
)
SLOW, FAST = "+data.dataset.delay_s=0.005", "+data.dataset.delay_s=0"
ELASTIC = (
    "launcher=torchrun",
    "trainer.nproc=1",
    "launcher.nnodes=1:2",
    "launcher.max_restarts=2",
    "launcher.rdzv_id=elastic",
    "+launcher.rdzv_conf.last_call_timeout=2",
)


def _node(hosts: TwoHosts, i: int, run_dir: Path):
    """One node's train.py: both nodes write to one run directory, as on a shared filesystem."""
    return start_train(
        run_dir,
        *ELASTIC,
        *DATA,
        SLOW,
        "trainer.threads=1",
        f"launcher.node_rank={i}",
        f"launcher.rdzv_endpoint={hosts.addresses[0]}:29613",
        f"launcher.local_addr={hosts.addresses[i]}",
        prefix=(
            "ip",
            "netns",
            "exec",
            hosts.names[i],
            "env",
            "GLOO_SOCKET_IFNAME=hddp0",
            sys.executable,
        ),
    )


def _resumed(tmp_path: Path, name: str, world: int, checkpoint: Path) -> Path:
    """An uninterrupted run at `world` ranks of one node from `checkpoint`, one thread a rank as the
    nodes', in the elastic run's micro-batches (16: its global batch of 32 over its most ranks,
    2)."""
    run_dir = tmp_path / name
    check_ok(
        run_train(
            run_dir,
            *DATA,
            FAST,
            f"trainer.nproc={world}",
            "trainer.threads=1",
            "data.batch_size=16",
            f"trainer.resume={checkpoint}",
            timeout=300,
        )
    )
    return run_dir


def _after(curve: list[tuple[int, str]], step: int) -> list[str]:
    return [loss for s, loss in curve if s > step]


def _until(curve: list[tuple[int, str]], step: int) -> list[str]:
    return [loss for s, loss in curve if s <= step]


def _one_curve(run_dir: Path) -> None:
    """TensorBoard and metrics.csv hold one continuous loss curve: every step once."""
    steps = [s for s, _ in step_losses(run_dir)]
    assert steps == list(range(1, summary(run_dir)["steps"] + 1))
    assert [s for s, _ in csv_step_losses(run_dir)] == steps


@pytest.mark.timeout(480)
def test_a_lost_node_leaves_the_other_to_finish_as_a_resumed_run_would(tmp_path: Path):
    run_dir = tmp_path / "run"
    with TwoHosts(str(os.getpid())) as hosts:
        nodes = [_node(hosts, i, run_dir) for i in range(2)]
        wait_for(
            lambda: (run_dir / "checkpoints" / "step-00000020.pt").exists(),
            180,
            "step 20's checkpoint",
            nodes[0],
        )
        os.killpg(nodes[1].pid, signal.SIGKILL)  # node 2's agent and worker, mid-epoch
        finish(nodes[1], timeout=30)
        check_ok(finish(nodes[0], timeout=300))
    s = summary(run_dir)
    start, resize = s["world_size_history"]
    assert start == {"step": 0, "world_size": 2, "cause": "start"}
    assert {k: resize[k] for k in ("from", "world_size", "cause")} == {
        "from": 2,
        "world_size": 1,
        "cause": "restart",
    }
    resumed = resize["step"]
    assert resumed >= 20 and resumed % 10 == 0 and (s["world_size"], s["steps"]) == (1, 90)
    # The resize keeps the global batch and the micro-batch; the accumulation makes up the lost
    # rank.
    assert (s["global_batch_size"], s["batch_size"], s["accumulate"]) == (32, 16, 2)
    _one_curve(run_dir)
    # After the resize: one rank resumed from that checkpoint, uninterrupted, bit for bit (the same
    # world size from the same checkpoint): every step's loss, the final weights and the test.
    alone = _resumed(tmp_path, "alone", 1, run_dir / "checkpoints" / f"step-{resumed:08d}.pt")
    assert _after(csv_step_losses(run_dir), resumed) == _after(csv_step_losses(alone), resumed)
    assert_same_params(final_params(run_dir), final_params(alone))
    assert s["test_loss"] == summary(alone)["test_loss"]
    # The whole run, and its test: as an uninterrupted run of 2 ranks, bit for bit up to the resize
    # (1 node of 2 ranks is the same run as 2 nodes of 1:
    # test_two_nodes_in_network_namespaces_match_one_node), then at another world size: within
    # float64's order noise, not bit for bit.
    two = tmp_path / "two"
    check_ok(run_train(two, *DATA, FAST, "trainer.nproc=2", "trainer.threads=1", timeout=300))
    assert _until(csv_step_losses(run_dir), resumed) == _until(csv_step_losses(two), resumed)
    assert_float64_alike(
        [float(v) for _, v in csv_step_losses(run_dir)] + [s["test_loss"]],
        [float(v) for _, v in csv_step_losses(two)] + [summary(two)["test_loss"]],
    )


@pytest.mark.timeout(480)
def test_a_node_that_joins_grows_the_run_as_a_resumed_run_would(tmp_path: Path):
    run_dir = tmp_path / "run"
    with TwoHosts(str(os.getpid())) as hosts:
        first = _node(hosts, 0, run_dir)  # alone: 1 of at most 2 nodes
        wait_for(
            lambda: (run_dir / "checkpoints" / "step-00000010.pt").exists(),
            180,
            "step 10's checkpoint",
            first,
        )
        second = _node(hosts, 1, run_dir)
        results = [finish(first, timeout=300), finish(second, timeout=300)]
    for result in results:
        check_ok(result)
    s = summary(run_dir)
    start, resize = s["world_size_history"]
    assert start == {"step": 0, "world_size": 1, "cause": "start"}
    assert {k: resize[k] for k in ("from", "world_size", "cause")} == {
        "from": 1,
        "world_size": 2,
        "cause": "rescale",
    }
    resumed = resize["step"]
    # The agent stops the group with SIGTERM to re-form it: the worker checkpoints where it stands.
    assert resumed >= 10 and (s["world_size"], s["steps"]) == (2, 90)
    # 2 of 16 after 1 × 2 × 16
    assert (s["global_batch_size"], s["batch_size"], s["accumulate"]) == (32, 16, 1)
    _one_curve(run_dir)
    # After the resize: 2 ranks resumed from that checkpoint, uninterrupted, bit for bit: every
    # step's loss, the final weights and the test.
    both = _resumed(tmp_path, "both", 2, run_dir / "checkpoints" / f"step-{resumed:08d}.pt")
    assert _after(csv_step_losses(run_dir), resumed) == _after(csv_step_losses(both), resumed)
    assert_same_params(final_params(run_dir), final_params(both))
    assert s["test_loss"] == summary(both)["test_loss"]
