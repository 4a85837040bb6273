"""The strategies against DDP and one rank on real gloo ranks: the same losses, exact resume from
sharded (DCP) checkpoints, resharding to another world size and strategy, eval.py on them."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from support import (
    assert_float64_alike,
    assert_same_params,
    check_ok,
    csv_losses,
    final_params,
    finish,
    float64,
    free_port,
    losses,
    run_eval,
    run_train,
    spawn_ranks,
    start_train,
    summary,
    wait_for,
)

STEPS = 24  # an epoch of digits on 2 ranks is 21 steps: one checkpoint at its end, at step 21
COMMON = (
    f"trainer.max_steps={STEPS}",
    "trainer.log_every=2",
    "checkpoint.every_n_steps=4",
    "trainer.threads=1",
    *float64(),
)


@pytest.mark.timeout(400)
def test_fsdp_trains_like_ddp_resumes_exactly_and_reshards(tmp_path: Path):
    sweep, stopped = tmp_path / "sweep", tmp_path / "stopped"
    # Both in one multirun: its jobs share the forkserver's imports (one start-up instead of two).
    check_ok(
        run_train(
            tmp_path / "unused", "-m", *COMMON, "strategy=ddp,fsdp", f"hydra.sweep.dir={sweep}"
        )
    )
    ddp, fsdp = sweep / "0", sweep / "1"
    # The same global batches: only the order of the gradient sums differs (float64: support.py).
    a, b = csv_losses(ddp), csv_losses(fsdp)
    assert len(a) == len(b) == STEPS
    assert_float64_alike(b, a)
    s = summary(fsdp)
    assert s["strategy"] == "fsdp" and summary(ddp)["strategy"] == "ddp"
    # Sharded: each rank holds about half of DDP's parameters, gradients and optimizer state.
    ratio = s["model_state_bytes"]["total"] / summary(ddp)["model_state_bytes"]["total"]
    assert 0.45 < ratio < 0.55, (s["model_state_bytes"], summary(ddp)["model_state_bytes"])
    # Sharded checkpoints: a directory per step, each rank's shards in it (DCP), the newest 3 kept,
    # `last` and `best` links to them; ddp's are one file per step.
    ckpts = fsdp / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [
        "best",
        "last",
        "step-00000020",
        "step-00000021",
        "step-00000024",
    ]
    assert (
        os.readlink(ckpts / "last") == "step-00000024"
        and os.readlink(ckpts / "best") == "step-00000021"
    )
    assert sorted(p.name for p in (ckpts / "last").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "meta.pt",
    ]
    assert (ddp / "checkpoints" / "step-00000024.pt").is_file()

    # Stopped by SIGTERM and resumed at 2 ranks: the uninterrupted run's weights, bit for bit.
    proc = start_train(stopped, *COMMON, "strategy=fsdp")
    wait_for(
        lambda: (stopped / "checkpoints" / "step-00000004").is_dir(),
        90,
        "the first checkpoint",
        proc,
    )
    os.kill(proc.pid, signal.SIGTERM)
    done = finish(proc, timeout=60)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    # What a crash mid-write leaves, and a corrupt newer one: resume=auto takes neither.
    saved = max((stopped / "checkpoints").glob("step-*"))
    kept = shutil.copytree(saved, tmp_path / "kept" / saved.name)  # the resume keeps the newest 3
    torn = stopped / "checkpoints" / ".step-00000099.tmp"
    shutil.copytree(saved, torn)
    (torn / ".metadata").unlink()
    corrupt = shutil.copytree(saved, stopped / "checkpoints" / "step-00000098")
    (corrupt / "meta.pt").write_bytes(b"PK\x03\x04 truncated")
    check_ok(run_train(stopped, *COMMON, "strategy=fsdp", "trainer.resume=auto"))
    assert (
        f"skipping checkpoint {str(corrupt)!r} is truncated or corrupt"
        in (stopped / "train.log").read_text()
    )
    assert summary(stopped)["resumed_from"] == str(saved) and summary(stopped)["steps"] == STEPS
    assert not torn.exists()  # cleared by the first save
    assert_same_params(final_params(stopped), final_params(fsdp))
    assert losses(stopped) == losses(fsdp)
    # The control: the same resume with the optimizer's state dropped as it starts (accelerate
    # #3971; tests/helpers/lost_state.py: SGD's momentum begins anew) ends at other weights.
    # (Resumed from that copy with its state, it ends at them.)
    lost, whole = tmp_path / "lost", tmp_path / "whole"
    check_ok(run_train(whole, *COMMON, "strategy=fsdp", f"trainer.resume={kept}"))
    assert_same_params(final_params(whole), final_params(fsdp))
    drops = "trainer.step={_target_:lost_state.DropsOptimizerState}"
    check_ok(run_train(lost, *COMMON, "strategy=fsdp", f"trainer.resume={kept}", drops))
    assert summary(lost)["steps"] == STEPS
    with pytest.raises(AssertionError):
        assert_same_params(final_params(lost), final_params(fsdp))

    # The epoch-end checkpoint (step 21, validated there) resumed on 1 rank under ddp (another world
    # size and another strategy at once): the same step, the same weights, so the same validation
    # loss (evaluation is exact at any world size; FSDP's gathered weights run other kernels' paths:
    # within float64's order noise, not bit for bit).
    epoch_end = fsdp / "checkpoints" / "step-00000021"
    at_21 = next(h for h in s["history"] if h["step"] == 21)
    resumed_dir = tmp_path / "one-rank-ddp"
    check_ok(
        run_train(
            resumed_dir,
            *COMMON[3:],
            "trainer.max_steps=21",
            "trainer.nproc=1",
            "strategy=ddp",
            f"trainer.resume={epoch_end}",
        )
    )
    resumed = summary(resumed_dir)
    assert resumed["steps"] == 21 and resumed["world_size"] == 1 and resumed["strategy"] == "ddp"
    assert_float64_alike([resumed["val_loss"]], [at_21["val_loss"]])


@pytest.mark.timeout(400)
def test_hsdp_on_a_2x2_mesh_trains_like_fsdp_resumes_exactly_and_reshards(tmp_path: Path):
    # HSDP: 2 copies of the model, each sharded over 2 neighbouring ranks; beside FSDP over all 4.
    four = (*COMMON, "trainer.nproc=4", "strategy=fsdp")
    sweep = tmp_path / "sweep"
    check_ok(
        run_train(
            tmp_path / "unused", "-m", *four, "strategy.replicate=1,2", f"hydra.sweep.dir={sweep}"
        )
    )
    fsdp, hsdp = sweep / "0", sweep / "1"
    # The same global batches (an epoch of digits at 4 ranks: 11 steps): the sums' order differs.
    assert len(csv_losses(hsdp)) == STEPS
    assert_float64_alike(csv_losses(hsdp), csv_losses(fsdp))
    s = summary(hsdp)
    assert (
        s["world_size"] == 4
        and s["hsdp"] == {"replicate": 2, "shard": 2}
        and summary(fsdp)["hsdp"] is None
    )
    # Each rank holds half the model (a copy's shard over 2), twice FSDP-over-4's quarter.
    ratio = s["model_state_bytes"]["total"] / summary(fsdp)["model_state_bytes"]["total"]
    assert 1.8 < ratio < 2.2, (s["model_state_bytes"], summary(fsdp)["model_state_bytes"])

    # Stopped by SIGTERM and resumed on the same mesh: the uninterrupted run, bit for bit.
    stopped = tmp_path / "stopped"
    proc = start_train(stopped, *four, "strategy.replicate=2")
    wait_for(
        lambda: (stopped / "checkpoints" / "step-00000004").is_dir(),
        120,
        "the first checkpoint",
        proc,
    )
    os.kill(proc.pid, signal.SIGTERM)
    done = finish(proc, timeout=60)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    check_ok(run_train(stopped, *four, "strategy.replicate=2", "trainer.resume=auto"))
    assert summary(stopped)["steps"] == STEPS and summary(stopped)["resumed_from"]
    assert_same_params(final_params(stopped), final_params(hsdp))
    assert losses(stopped) == losses(hsdp)

    # Its DCP checkpoint resharded to plain FSDP over 2 ranks: that step's validation again; and
    # eval.py on the run at 1 rank gives its test metrics (float64's order noise: gathered weights).
    epoch_end = (hsdp / "checkpoints" / "best").resolve()  # a validated step
    at = next(h for h in s["history"] if h["step"] == int(epoch_end.name[5:]))
    resharded = tmp_path / "resharded"
    check_ok(
        run_train(
            resharded,
            *COMMON[3:],
            f"trainer.max_steps={at['step']}",
            "strategy=fsdp",
            "data.global_batch_size=128",  # 4 ranks' global batch: 2 micro-batches per rank
            f"trainer.resume={epoch_end}",
        )
    )
    assert summary(resharded)["world_size"] == 2
    assert_float64_alike([summary(resharded)["val_loss"]], [at["val_loss"]])
    check_ok(run_eval(tmp_path / "eval", f"ckpt={hsdp}", "trainer.nproc=1"))
    evaluated = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert evaluated["test_samples"] == s["test_samples"]
    assert_float64_alike([evaluated["test_loss"]], [s["test_loss"]])


def test_hsdp_refuses_a_world_size_it_does_not_divide_in_one_line(tmp_path: Path):
    proc = run_train(tmp_path / "run", "strategy=fsdp", "strategy.replicate=3", "trainer.nproc=4")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "hydra-ddp: error: strategy=fsdp: strategy.replicate=3 does "
        "not divide the 4 ranks (trainer.nproc × launcher.nnodes): "
        "give a divisor of 4 (launcher.nnodes: a copy per node)"
    ], proc.stderr
    assert not (tmp_path / "run").exists()


# The transformer, small: 2 blocks of width 32 on 64 KiB of text; a global batch of 32 sequences
# (25 steps an epoch), so one rank, FSDP over 2 and tensor parallel over 2 all train on the same
# batches.
GPT = (
    "+experiment=text_gpt",
    "model.dim=32",
    "model.depth=2",
    "data.dataset.context=32",
    "data.dataset.max_bytes=65536",
    "data.global_batch_size=32",
    "trainer.max_steps=20",
    "trainer.log_every=2",
    *float64("hydra_ddp.models.TinyGPT"),
)


@pytest.mark.timeout(300)
def test_fsdp_and_tensor_parallel_train_the_transformer_like_one_rank(tmp_path: Path):
    # fsdp_tp: 4 processes on a 2×2 mesh (tensor parallel in pairs, FSDP across the pairs).
    # The sharded runs use the optimizer's foreach kernels, CUDA's default (the CPU's is a loop):
    # they must never see one list mixing TP's DTensors with plain tensors or another mesh's.
    foreach = "+optim.foreach=true"
    runs = {
        "one-rank": ("trainer.nproc=1",),
        "fsdp_tp": (
            "strategy=fsdp_tp",
            "trainer.nproc=4",
            "strategy.tp_size=2",
            "trainer.threads=1",
            foreach,
        ),
    }
    for name, overrides in runs.items():
        check_ok(run_train(tmp_path / name, *GPT, *overrides))
    # fsdp and tp at 2 ranks in one multirun (jobs 0 and 1), sharing the forkserver's imports.
    sweep = f"hydra.sweep.dir={tmp_path / 'sweep'}"
    check_ok(run_train(tmp_path / "unused", "-m", *GPT, "strategy=fsdp,tp", foreach, sweep))
    (tmp_path / "sweep" / "0").rename(tmp_path / "fsdp")
    (tmp_path / "sweep" / "1").rename(tmp_path / "tp")
    runs.update(fsdp=(), tp=())
    # float64: only the order of sums differs between them (support.py).
    reference = csv_losses(tmp_path / "one-rank")
    assert len(reference) == 20
    s = {name: summary(tmp_path / name) for name in runs}
    # gradient clipping at 1 (the experiment's) included: a global norm
    for name in ("fsdp", "tp", "fsdp_tp"):
        assert_float64_alike(csv_losses(tmp_path / name), reference)
    # The control: FSDP clipping each rank's shards by their own norm (pytorch #149768) moves the
    # losses beyond the bound the comparison above holds.
    local = "trainer.step={_target_:local_clip.LocalNormClip,max_norm:1.0}"
    check_ok(run_train(tmp_path / "local", *GPT, "strategy=fsdp", "trainer.grad_clip=null", local))
    clipped_locally = csv_losses(tmp_path / "local")
    assert len(clipped_locally) == len(reference)
    with pytest.raises(AssertionError, match="float64 runs apart by up to"):
        assert_float64_alike(clipped_locally, reference)
    for name in ("tp", "fsdp_tp"):  # the validation after 20 steps: as far apart as the weights
        assert_float64_alike([s[name]["val_loss"]], [s["one-rank"]["val_loss"]])
        # every token once, not per tp rank
        assert s[name]["test_samples"] == s["one-rank"]["test_samples"], name
    held = {name: s[name]["model_state_bytes"]["total"] for name in runs}
    # FSDP: half of everything; TP: half of the blocks' linears (embeddings, norms and head
    # replicated).
    assert (
        0.45 < held["fsdp"] / held["one-rank"] < 0.55
        and 0.55 < held["tp"] / held["one-rank"] < 0.85
    ), held
    # tensor parallel's share, sharded again over 2
    assert 0.45 < held["fsdp_tp"] / held["tp"] < 0.55, held

    # eval.py on the 2-D mesh's sharded checkpoint, in one process: the run's own test loss.
    check_ok(run_eval(tmp_path / "eval", f"ckpt={tmp_path / 'fsdp_tp'}", "trainer.nproc=1"))
    evaluated = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert evaluated["step"] == 20 and evaluated["test_samples"] == s["fsdp_tp"]["test_samples"]
    # the mesh split its matmuls
    assert_float64_alike([evaluated["test_loss"]], [s["fsdp_tp"]["test_loss"]])


def _tied_and_wrapped() -> torch.nn.Module:  # noqa: F821  (torch is imported inside)
    """A module with a parameter two layers share and a layer inside activation checkpointing's
    wrapper: the cases where a parameter's name is not simply its path."""
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(16, 8)
            self.body = checkpoint_wrapper(torch.nn.Linear(8, 8))
            self.head = torch.nn.Linear(8, 16, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # (batch, classes, time)
            return self.head(torch.relu(self.body(self.embed(x)))).transpose(1, 2)

    return Tied()


def _named_like_dcp(_rank: int, port: int) -> None:
    import io

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hydra_ddp.models import MnistCNN, TinyGPT
    from hydra_ddp.parallel.layouts import optimizer_state_by_name

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    torch.manual_seed(0)
    gpt = TinyGPT(context=8, dim=16, depth=2, heads=2)
    decay = [p for p in gpt.parameters() if p.dim() >= 2]
    cases = [
        (
            MnistCNN(),
            lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
            (4, 1, 28, 28),
            10,
        ),
        # no state at all
        (MnistCNN(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1), (4, 1, 28, 28), 10),
        (
            gpt,
            lambda m: torch.optim.AdamW(
                [
                    {"params": decay},
                    {"params": [p for p in m.parameters() if p.dim() < 2], "weight_decay": 0.0},
                ],
                lr=1e-3,
            ),
            (4, 8),
            256,
        ),
        (_tied_and_wrapped(), lambda m: torch.optim.Adam(m.parameters(), lr=1e-3), (4, 3), 16),
    ]
    for module, make_optimizer, shape, classes in cases:
        model = DDP(module)
        optimizer = make_optimizer(model)
        for _ in range(2):  # state exists after a step (SGD without momentum keeps none)
            x = torch.randn(shape) if len(shape) == 4 else torch.randint(0, classes, shape)
            out = model(x)
            target = torch.randint(0, classes, out.shape[:1] + out.shape[2:])
            F.cross_entropy(out, target).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        ours, theirs = (
            optimizer_state_by_name(module, optimizer),
            get_optimizer_state_dict(model, optimizer),
        )
        assert list(ours) == list(theirs) and list(ours["state"]) == list(theirs["state"])
        assert ours["param_groups"] == theirs["param_groups"]
        for name, values in ours["state"].items():
            assert list(values) == list(theirs["state"][name])
            assert all(torch.equal(v, theirs["state"][name][k]) for k, v in values.items())
        # The checkpoint's bytes: the same file either way.
        a, b = io.BytesIO(), io.BytesIO()
        torch.save(ours, a)
        torch.save(theirs, b)
        assert a.getvalue() == b.getvalue()
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_ddp_optimizer_state_is_named_as_dcp_names_it():
    """strategy.optimizer_state_by_name against torch.distributed.checkpoint's
    get_optimizer_state_dict on real DDP models: the same names, groups, tensors, and bytes once
    saved."""
    spawn_ranks(_named_like_dcp, (free_port(),))
