"""Model FLOPs against a hand count, the peak's table and measurement, and the MFU's arithmetic."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hydra_ddp.blueprint import Building
from hydra_ddp.models import MLP, MnistCNN, TinyGPT
from hydra_ddp.reporting import flops


def _pair_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def _count(build, batch: int, inputs: tuple[int, ...]) -> int:
    x = torch.empty(batch, *inputs, device="meta")
    return flops.count(
        Building(build), _pair_loss, (x, torch.empty(batch, dtype=torch.int64, device="meta"))
    )


def test_the_mlps_count_is_the_hand_count():
    """Linear layers: 2·in·out FLOPs a sample forward; backward the gradient of the weight (as much
    again) and of the input (as much again), except the first layer's: its input needs none."""
    layers = [(784, 256), (256, 128), (128, 10)]
    forward = sum(2 * i * o for i, o in layers)
    backward = sum(2 * 2 * i * o for i, o in layers) - 2 * 784 * 256
    assert _count(lambda: MLP(784, 10, (256, 128)), 32, (1, 28, 28)) == 32 * (forward + backward)


def test_the_cnns_count_is_the_hand_count():
    """Convolutions: 2·C_out·H_out·W_out·C_in·k² a sample (then as for the linear layers)."""
    conv1 = 2 * 20 * 24 * 24 * 1 * 5 * 5  # 28×28 → 24×24, pooled to 12×12
    conv2 = 2 * 50 * 8 * 8 * 20 * 5 * 5  # 12×12 → 8×8, pooled to 4×4
    fc1, fc2 = 2 * 800 * 500, 2 * 500 * 10
    forward = conv1 + conv2 + fc1 + fc2
    backward = 2 * forward - conv1  # no gradient for the images
    assert forward + backward == 13_182_000
    assert _count(lambda: MnistCNN(1, 10, 28), 8, (1, 28, 28)) == 8 * 13_182_000


def test_the_transformers_count_is_the_palm_formula():
    """A decoder's training FLOPs a sequence: 6·N·T for the weight matmuls (N: the non-embedding
    parameters with the head; 2 forward, 4 backward) plus 12·L·T²·d for attention's scores and
    mixing (PaLM, appendix B). Token and position look-ups are not matmuls."""
    dim, depth, context, vocab = 128, 4, 64, 256
    n = depth * 12 * dim * dim + dim * vocab  # q, k, v, out: 4·d²; the MLP: 8·d²; the head
    count = flops.count(
        Building(lambda: TinyGPT(vocab, context, dim, depth, heads=4, mlp_ratio=4)),
        _pair_loss,
        [torch.empty(8, context, dtype=torch.int64, device="meta")] * 2,
    )
    assert count == 8 * (6 * n * context + 12 * depth * context**2 * dim)


def test_counting_builds_nothing_real():
    """On the meta device: a model far too big for this machine is counted, not allocated."""
    count = _count(lambda: MLP(100_000, 10, (100_000,)), 4, (100_000,))
    assert count == 4 * (2 * 100_000 * 100_000 * 2 + 2 * 100_000 * 10 * 3)


def test_gpu_peaks_follow_the_precision_and_the_name():
    assert flops.gpu_peak("NVIDIA H100 80GB HBM3", "bf16", tf32=False) == (
        989e12,
        "H100 bf16 data-sheet peak",
    )
    assert flops.gpu_peak("NVIDIA H100 PCIe", "16", tf32=False)[0] == 756e12
    assert flops.gpu_peak("NVIDIA A100-SXM4-80GB", "32", tf32=True)[0] == 156e12
    assert flops.gpu_peak("NVIDIA A100-SXM4-80GB", "32", tf32=False)[0] == 19.5e12
    assert flops.gpu_peak("NVIDIA H200", "bf16", tf32=False)[0] == 989e12
    assert flops.gpu_peak("Some Future GPU", "bf16", tf32=False) is None
    value, source = flops.peak(torch.device("cpu"), "32", 1, override=2.5e12)
    assert (value, source) == (2.5e12, "trainer.peak_flops")


def test_the_cpu_peak_is_measured_at_the_runs_dtype_and_named_as_measured():
    value, source = flops.peak(torch.device("cpu"), "32", torch.get_num_threads(), override=None)
    assert (
        value > 0
        and source == f"measured: fp32 256×256 matmul, {torch.get_num_threads()} thread(s) per rank"
    )
    value, source = flops.peak(torch.device("cpu"), "bf16", 1, override=None)
    assert value > 0 and source.startswith("measured: bf16")


def test_the_report_divides_the_model_flops_over_the_ranks():
    r = flops.report(1e6, 1000.0, world_size=4, peak_flops=1e9, source="trainer.peak_flops")
    assert r["per_sec_per_rank"] == pytest.approx(2.5e8) and r["mfu"] == pytest.approx(0.25)
    assert "250 MFLOP/s per rank (1 MFLOP per sample" in flops.line(
        r
    ) and "MFU 0.250 of 1 GFLOP/s" in flops.line(r)
    no_peak = flops.report(
        1e6,
        1000.0,
        world_size=4,
        peak_flops=None,
        source="X is not in the table: set trainer.peak_flops",
    )
    assert no_peak["mfu"] is None and flops.line(no_peak).endswith(
        "no MFU: X is not in the table: set trainer.peak_flops"
    )
    assert flops.report(None, 1000.0, 4, 1e9, "s")["per_sec_per_rank"] is None
