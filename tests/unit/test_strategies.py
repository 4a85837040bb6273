"""A strategy's settings as the model sees them, on a one-rank gloo group in this process: FSDP2's
mixed-precision policy (param_dtype, reduce_dtype, output_dtype)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from hydra_ddp.config.strategy_settings import FSDPSettings
from hydra_ddp.models import TinyGPT
from hydra_ddp.parallel.strategies.fsdp import FSDP


@pytest.fixture
def one_rank(tmp_path: Path):
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_fsdp_computes_in_param_dtype_reduces_in_reduce_dtype_and_returns_output_dtype(one_rank):
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=64, context=16, dim=32, depth=2, heads=4)
    settings = FSDPSettings(param_dtype="bf16", reduce_dtype="fp32", output_dtype="fp32")
    strategy = FSDP(
        SimpleNamespace(strategy=settings, trainer=SimpleNamespace(compile=False)),
        torch.device("cpu"),
    )
    wrapped = strategy.wrap(model)
    seen = []
    model.blocks[0].fc1.register_forward_hook(
        lambda module, inputs, output: seen.append(output.dtype)
    )
    logits = wrapped(torch.randint(0, 64, (2, 16)))
    # the compute, and the loss's input
    assert seen == [torch.bfloat16] and logits.dtype == torch.float32
    logits.float().sum().backward()
    grads = {p.grad.dtype for p in wrapped.parameters() if p.grad is not None}
    params = {p.dtype for p in wrapped.parameters()}
    # the shards and their gradients stay fp32
    assert grads == {torch.float32} and params == {torch.float32}
