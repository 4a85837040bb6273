"""The training recipe's pure parts: per-step learning-rate schedules (their shapes, their resume,
their refusals), when the loop steps a schedule, and the optimizer's weight-decay groups."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from hydra_ddp.errors import UserError
from hydra_ddp.models import TinyGPT
from hydra_ddp.recipe import optimizer as optimizers
from hydra_ddp.recipe import schedules


def _optimizer(lr: float = 0.5) -> torch.optim.Optimizer:
    return torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=lr)


def _rates(schedule: schedules.StepSchedule, steps: int) -> list[float]:
    """The rate each optimizer step 1 … steps takes, as the loop sets them."""
    rates = []
    for step in range(1, steps + 1):
        rates.append(schedule.get_last_lr()[0])
        schedule.at(step)
    return rates


def test_warmup_rises_linearly_to_the_rate_then_cosine_falls_to_the_floor():
    rates = _rates(
        schedules.warmup_cosine(_optimizer(), total_steps=20, warmup_steps=4, min_lr_ratio=0.1), 20
    )
    # (step + 1) / warmup: no step at rate 0
    assert rates[:4] == [0.5 * k / 4 for k in (1, 2, 3, 4)]
    decay = [0.05 + 0.45 * 0.5 * (1 + math.cos(math.pi * k / 16)) for k in range(16)]
    assert rates[4:] == pytest.approx(decay, rel=1e-15)
    assert all(a >= b for a, b in zip(rates[4:], rates[5:])) and rates[-1] > 0.05


def test_linear_constant_and_wsd_shapes():
    linear = _rates(schedules.warmup_linear(_optimizer(1.0), total_steps=10, warmup_steps=2), 10)
    assert linear == pytest.approx([0.5, 1.0, 1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125])
    constant = _rates(
        schedules.warmup_constant(_optimizer(1.0), total_steps=10, warmup_ratio=0.2), 10
    )
    assert constant == [0.5, 1.0] + [1.0] * 8
    wsd = _rates(
        schedules.wsd(_optimizer(1.0), total_steps=10, warmup_steps=2, decay_ratio=0.4), 10
    )
    assert wsd == pytest.approx([0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.75, 0.5, 0.25])
    sqrt = _rates(schedules.wsd(_optimizer(1.0), total_steps=10, decay_ratio=0.4, decay="sqrt"), 10)
    assert sqrt[6:] == pytest.approx(
        [1.0, 1 - math.sqrt(0.25), 1 - math.sqrt(0.5), 1 - math.sqrt(0.75)]
    )


def test_a_resumed_schedule_takes_the_same_rates_bit_for_bit():
    straight = _rates(schedules.warmup_cosine(_optimizer(0.3), total_steps=50, warmup_steps=7), 50)
    first = schedules.warmup_cosine(_optimizer(0.3), total_steps=50, warmup_steps=7)
    before = _rates(first, 5)  # stopped mid-warmup
    # a new process: the optimizer's saved groups, then the schedule's state
    optimizer = _optimizer(0.3)
    optimizer.load_state_dict(first.optimizer.state_dict())
    resumed = schedules.warmup_cosine(optimizer, total_steps=50, warmup_steps=7)
    resumed.load_state_dict(first.state_dict())
    after = []
    for step in range(6, 51):
        after.append(resumed.get_last_lr()[0])
        resumed.at(step)
    assert before + after == straight


def test_every_parameter_group_scales_from_its_own_rate():
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(
        [{"params": [model.weight]}, {"params": [model.bias], "lr": 0.1}], lr=1.0
    )
    schedule = schedules.warmup_linear(optimizer, total_steps=4, warmup_steps=2)
    assert schedule.get_last_lr() == [0.5, 0.05]


@pytest.mark.parametrize(
    "build, words",
    [
        (
            lambda o: schedules.warmup_cosine(o, total_steps=10, warmup_steps=10),
            "not shorter than the run's 10",
        ),
        (lambda o: schedules.warmup_cosine(o, total_steps=None), "set trainer.max_steps"),
        (
            lambda o: schedules.warmup_linear(o, total_steps=10, warmup_ratio=1.5),
            "warmup_ratio=1.5",
        ),
        (
            lambda o: schedules.warmup_cosine(o, total_steps=10, min_lr_ratio=2.0),
            "min_lr_ratio=2.0",
        ),
        (lambda o: schedules.wsd(o, total_steps=10, decay="step"), "decay='step'"),
        (lambda o: schedules.wsd(o, total_steps=10, warmup_steps=5, decay_ratio=0.6), "overlap"),
    ],
)
def test_a_schedule_that_cannot_be_is_one_line(build, words: str):
    with pytest.raises(UserError) as refused:
        build(_optimizer())
    assert words in str(refused.value) and "\n" not in str(refused.value)


def test_build_gives_a_per_step_schedule_the_runs_length_and_torchs_the_optimizer_alone():
    per_step = OmegaConf.create(
        {"_target_": "hydra_ddp.recipe.schedules.warmup_cosine", "_partial_": True}
    )
    per_epoch = OmegaConf.create(
        {"_target_": "torch.optim.lr_scheduler.StepLR", "_partial_": True, "step_size": 2}
    )
    assert schedules.takes_length(per_step) and not schedules.takes_length(per_epoch)
    built = schedules.build(per_step, _optimizer(), total_steps=30)
    assert schedules.per_step(built) and built.shape.total == 30
    assert isinstance(schedules.build(per_epoch, _optimizer(), 30), torch.optim.lr_scheduler.StepLR)
    assert schedules.build(None, _optimizer(), 30) is None


def test_the_loop_steps_a_per_step_schedule_each_step_and_torchs_each_epoch():
    optimizer = _optimizer(1.0)
    stepping = schedules.Stepping(
        schedules.warmup_linear(optimizer, total_steps=4, warmup_steps=2), optimizer
    )
    for step in (1, 2, 3):
        stepping.optimizer_stepped(step)
    assert stepping.take_rates(up_to=2) == {1: 0.5, 2: 1.0}  # step 3's waits for its loss
    assert stepping.take_rates(up_to=3) == {3: 1.0} and stepping.epoch_rate() == {}
    stepping.epoch_started(1)  # a rank that caught up: the rate of the step it stands at
    assert optimizer.param_groups[0]["lr"] == 1.0

    optimizer = _optimizer(1.0)
    stepping = schedules.Stepping(
        torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5), optimizer
    )
    optimizer.step()
    stepping.optimizer_stepped(1)
    assert stepping.take_rates(1) == {} and stepping.epoch_rate() == {"train/lr": 1.0}
    stepping.epoch_ended()
    assert optimizer.param_groups[0]["lr"] == 0.5


def _gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab_size=16, context=8, dim=8, depth=2, heads=2, mlp_ratio=2)


def test_auto_leaves_biases_norms_and_embeddings_undecayed():
    names = optimizers.no_decay_names(_gpt(), "auto")
    assert "tokens.weight" in names and "positions.weight" in names and "norm.weight" in names
    assert "blocks.0.norm1.bias" in names and "blocks.1.fc1.bias" in names
    decayed = {n for n, _ in _gpt().named_parameters()} - set(names)
    assert decayed == {
        f"blocks.{i}.{m}.weight" for i in (0, 1) for m in ("q", "k", "v", "proj", "fc1", "fc2")
    } | {"head.weight"}


def test_patterns_name_parameters_and_a_pattern_that_names_none_is_reported():
    assert optimizers.no_decay_names(_gpt(), ["*.bias"]) == [
        n for n, _ in _gpt().named_parameters() if "bias" in n
    ]
    assert optimizers.unmatched(_gpt(), ["*.bias", "blocks.*.gamma"]) == ["blocks.*.gamma"]


def test_undecayed_parameters_do_not_shrink_and_the_rest_do():
    model = _gpt()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optim_cfg = OmegaConf.create(
        {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 0.1, "weight_decay": 0.5}
    )
    optimizer = optimizers.build(optim_cfg, "auto", model, model)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.5, 0.0]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # no gradient: only the decay moves a weight
    optimizer.step()
    undecayed = set(optimizers.no_decay_names(model, "auto"))
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]) == (name in undecayed), name


def test_without_groups_the_optimizer_takes_the_wrapped_models_parameters_as_before():
    model = _gpt()
    optim_cfg = OmegaConf.create({"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.1})
    optimizer = optimizers.build(optim_cfg, "none", model, model)
    assert len(optimizer.param_groups) == 1
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [
        id(p) for p in model.parameters()
    ]


def _saved_bytes_and_grads(
    mode: str, every: int = 2
) -> tuple[int, torch.Tensor, dict[str, torch.Tensor]]:
    """One forward and backward of the GPT with `mode`: the bytes autograd saved for the backward,
    the loss, and the gradients by name."""
    from types import SimpleNamespace

    from hydra_ddp.recipe import activation_checkpointing

    model = _gpt()
    activation_checkpointing.apply(
        model, SimpleNamespace(activation_checkpointing=mode, activation_checkpointing_every=every)
    )
    tokens = torch.randint(0, 16, (4, 8), generator=torch.Generator().manual_seed(1))
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = nn.functional.cross_entropy(model(tokens), tokens)
    loss.backward()
    return sum(saved), loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_activation_checkpointing_saves_less_and_computes_the_same_bits():
    plain_bytes, plain_loss, plain_grads = _saved_bytes_and_grads("none")
    for mode in ("full", "every_k"):
        saved, loss, grads = _saved_bytes_and_grads(mode)
        assert saved < plain_bytes, mode
        # names unchanged
        assert torch.equal(loss, plain_loss) and grads.keys() == plain_grads.keys()
        assert all(torch.equal(grads[n], plain_grads[n]) for n in grads), mode
    assert _saved_bytes_and_grads("full")[0] < _saved_bytes_and_grads("every_k")[0]


def test_blocks_are_the_models_own_and_every_k_picks_from_the_first():
    from hydra_ddp.recipe import activation_checkpointing

    gpt = _gpt()
    assert activation_checkpointing.blocks(gpt) == list(gpt.blocks)
    assert activation_checkpointing.blocks(nn.Sequential(nn.Linear(2, 2))) is None
    assert activation_checkpointing.chosen(list(range(5)), "every_k", 2) == [0, 2, 4]
    assert activation_checkpointing.chosen(list(range(5)), "full", 2) == list(range(5))


@pytest.mark.parametrize(
    "overrides, refused",
    [
        (
            ("scheduler=warmup_cosine", "trainer.max_steps={}"),
            True,
        ),  # warmup and decay: the length's
        (("scheduler=wsd", "trainer.max_steps={}"), True),
        # a fixed warmup, then a constant rate: the same rates at any length
        (
            (
                "scheduler=warmup_cosine",
                "scheduler.warmup_steps=3",
                "scheduler.min_lr_ratio=1.0",
                "trainer.max_steps={}",
            ),
            False,
        ),
        (("scheduler=cosine", "trainer.epochs={}"), True),  # by epoch, its T_max the epochs
        (("scheduler=step", "trainer.epochs={}"), False),  # by epoch, of fixed step_size
        (("scheduler=none", "trainer.max_steps={}"), False),
    ],
    ids=["warmup-cosine", "wsd", "warmup-then-constant", "cosine-by-epoch", "step", "none"],
)
def test_a_new_length_on_resume_is_refused_only_where_the_rates_would_move(
    tmp_path, overrides: tuple[str, ...], refused: bool
):
    from hydra_ddp.config import run_config
    from hydra_ddp.config.schema import register_schema
    from hydra_ddp.launch.continuing import changed_length

    from support import resolved

    register_schema()

    def at(length: int):
        return resolved(tmp_path, *(o.format(length) for o in overrides))

    saved = run_config.thaw(at(6))
    assert changed_length(saved, at(6)) is None  # the run's own length
    line = changed_length(saved, at(12))
    assert (line is not None) == refused, line
    if refused:
        assert "→ 12 on resume" in line and "trainer.init_from=RUN_DIR" in line


def test_the_shards_experiment_trains_with_the_documents_experiments_recipe():
    """+experiment=shards_gpt is documents_gpt read from shards: the same optimizer, schedule,
    parameter groups, clipping, length and global batch; only the data differs."""
    import yaml

    conf = Path(__file__).resolve().parents[2] / "conf" / "experiment"
    documents, shards = (
        yaml.safe_load((conf / f"{n}.yaml").read_text()) for n in ("documents_gpt", "shards_gpt")
    )
    for key in ("optim", "param_groups", "scheduler", "trainer"):
        assert shards[key] == documents[key], key
    assert shards["data"]["global_batch_size"] == documents["data"]["global_batch_size"]
    assert shards["model"]["context"] == documents["data"]["dataset"]["context"]
    assert [d for d in shards["defaults"] if "override /data" not in d] == [
        d for d in documents["defaults"] if "override /data" not in d
    ]
    assert {"override /data": "shards"} in shards["defaults"]
