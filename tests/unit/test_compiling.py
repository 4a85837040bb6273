"""trainer.compile (recipe/compiling.py): what `true` means for a model, and each block's forward
compiled in place: the module, its parameter names and its results unchanged (the `eager` backend
traces with dynamo and runs the same kernels, so bit-equal; inductor's fused kernels are
tests/e2e/test_compile.py's)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F

from hydra_ddp.errors import UserError
from hydra_ddp.models import MnistCNN, TinyGPT
from hydra_ddp.recipe import activation_checkpointing, compiling


def _gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab_size=32, context=16, dim=16, depth=3, heads=2, mlp_ratio=2)


def test_true_is_the_blocks_where_the_model_names_them_else_the_whole_model():
    assert compiling.mode(True, _gpt()) == "blocks"
    assert compiling.mode(True, MnistCNN()) == "model"
    # a model that does not build before launch: as before
    assert compiling.mode(True, None) == "model"
    for setting in (False, "blocks", "model"):
        assert compiling.mode(setting, _gpt()) == setting
    with pytest.raises(
        UserError, match="trainer.compile=blocks compiles the model's blocks .* MnistCNN names none"
    ):
        compiling.check("blocks", MnistCNN(), "MnistCNN")


def _step(model: TinyGPT, tokens: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(tokens), tokens)  # logits (batch, vocabulary, positions)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "activation-checkpointed"])
def test_each_blocks_forward_is_compiled_in_place_with_the_same_names_and_results(
    checkpointed: bool,
):
    torch._dynamo.reset()
    model, reference = _gpt(), _gpt()
    if checkpointed:  # as the strategies order them: checkpointing first, its wrapper traced
        for m in (model, reference):
            activation_checkpointing.apply(
                m,
                SimpleNamespace(activation_checkpointing="full", activation_checkpointing_every=1),
            )
    names = list(reference.state_dict())
    trainer = SimpleNamespace(compile="blocks", compile_backend="eager")
    assert compiling.compile_blocks(model, trainer) == 3
    # checkpoints read as before
    assert type(model) is TinyGPT and list(model.state_dict()) == names
    assert (
        compiling.compile_blocks(
            reference, SimpleNamespace(compile="model", compile_backend="eager")
        )
        == 0
    )
    tokens = torch.randint(0, 32, (4, 16), generator=torch.Generator().manual_seed(1))
    torch._dynamo.utils.counters.clear()
    loss, grads = _step(model, tokens)
    expected_loss, expected_grads = _step(reference, tokens)
    assert torch.equal(loss, expected_loss)
    assert all(torch.equal(g, e) for g, e in zip(grads, expected_grads))
    # Dynamo traced the blocks (the other parts of the model ran eagerly), the three alike in one
    # graph.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_inductors_caches_go_to_the_run_unless_the_environment_names_its_own(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    compiling.use_run_cache(tmp_path)
    import os

    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "compile_cache")
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # as importing inductor sets it
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    compiling.use_run_cache(tmp_path)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "compile_cache")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")
    compiling.use_run_cache(tmp_path)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/elsewhere"


def test_static_shapes_but_where_batches_are_padded_to_lengths_that_vary():
    """Fixed-shape batches differ only in the epoch's last: a static graph of its own, not a dynamic
    one that would then run every batch (tests/e2e/test_compile.py trains so)."""
    from torch.utils.data import TensorDataset

    from hydra_ddp.data.text import PadCollate

    assert compiling.dynamic(TensorDataset(torch.zeros(4, 2))) is False
    assert compiling.dynamic(SimpleNamespace(collate=PadCollate(0))) is None  # dynamo's own choice
