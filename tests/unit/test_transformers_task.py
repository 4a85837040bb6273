"""The causal language model task against transformers' own loss, FSDP's units for a Hugging Face
model, the CPU fallback of the shapes-only runs, and a missing extra named before launch."""

from __future__ import annotations

import pytest
import torch

from hydra_ddp.blueprint import Building
from hydra_ddp.errors import UserError
from hydra_ddp.hf import causal_lm
from hydra_ddp.launch import checks
from hydra_ddp.parallel.strategies.fsdp import shard_units
from hydra_ddp.reporting.flops import run_shapes_only
from hydra_ddp.tasks import CausalLM

pytest.importorskip("transformers")  # the extra: .ci/run installs it; under CI=true a skip fails

SMALL = dict(
    vocab_size=256,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=64,
)
GPT2 = dict(architecture="gpt2", vocab_size=256, n_embd=32, n_layer=2, n_head=4, n_positions=64)


def _batch(ignored: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 256, (3, 17), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :ignored] = -100  # padding, say: counts in no loss
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


@pytest.mark.parametrize("ignored", [0, 5])
@pytest.mark.parametrize("config", [SMALL, GPT2], ids=["llama", "gpt2"])
def test_the_states_sums_give_the_models_own_mean_loss(ignored: int, config: dict):
    torch.manual_seed(0)
    model, task = causal_lm(**config), CausalLM()
    batch = _batch(ignored)
    output, target = task.forward(model, batch)
    loss_sum, correct, count = task.state(output, target).tolist()
    # position t predicts label t+1; -100 ones do not count
    assert count == 3 * (16 - max(ignored - 1, 0))
    # The model's own loss is the mean over the same tokens (float32 there, float64 sums here).
    assert loss_sum / count == pytest.approx(task.loss(output, target).item(), rel=1e-6)
    assert task.tokens(batch) == count and task.samples(batch) == 3
    rows = task.predict(output, target)
    assert (
        rows.shape == (3, 3)
        and rows[:, 0].sum().item() == count
        and rows[:, 1].sum().item() == correct
    )


def test_fsdp_shards_a_hugging_face_model_by_its_decoder_layers():
    assert [type(u).__name__ for u in shard_units(causal_lm(**SMALL))] == ["LlamaDecoderLayer"] * 2
    assert [type(u).__name__ for u in shard_units(causal_lm(**GPT2))] == ["GPT2Block"] * 2


def test_a_model_that_reads_its_inputs_values_runs_on_the_cpu_instead_of_meta():
    task = CausalLM()
    batch = _batch()
    meta = {k: torch.empty_like(v, device="meta") for k, v in batch.items()}
    loss = run_shapes_only(
        Building(lambda: causal_lm(**SMALL)),
        lambda m, b: task.loss(*task.forward(m, b)),
        meta,
        batch,
    )
    # sdpa's mask check reads the mask: not on meta
    assert loss.device.type == "cpu" and loss.dim() == 0
    with pytest.raises(RuntimeError, match="meta"):
        run_shapes_only(
            Building(lambda: causal_lm(**SMALL)),
            lambda m, b: task.loss(*task.forward(m, b)),
            meta,
            None,
        )


def test_a_models_missing_package_is_one_line_before_launch(monkeypatch):
    from hydra_ddp import hf as models

    monkeypatch.setattr(
        models.causal_lm, "requires", (("no_such_package_42", "Nothing", "pip install nothing"),)
    )
    with pytest.raises(
        UserError,
        match=r"model=hf_llama needs Nothing \(no_such_package_42\), which is not installed",
    ):
        checks._check_requires("hydra_ddp.hf.causal_lm", "model", "model=hf_llama")


def test_an_unknown_architecture_is_one_line():
    with pytest.raises(UserError, match="model.architecture='no-such-model'"):
        causal_lm(architecture="no-such-model")
