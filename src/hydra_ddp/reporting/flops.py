"""Model FLOPs and FLOP utilisation (MFU): one step counted on a meta-device copy of the model,
against a peak.

Counted with torch's own FlopCounterMode (matmuls, convolutions, attention; elementwise ops are
not counted, as in every MFU figure of the field). On the meta device nothing is computed or
allocated, so the count costs no time at any model size and needs no collective: a sharded
(FSDP, TP) model's count is the whole model's, divided over the ranks as the work is.

The peak: `trainer.peak_flops` when set; on a GPU, the vendor's dense figure from PEAK_FLOPS for
the run's precision; on the CPU, a short matmul measured on every rank at once, at the run's
threads and dtype (so two ranks sharing cores share them here too), reported as measured.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Optional, Protocol

import torch

log = logging.getLogger(__name__)

# Dense (no sparsity) peak FLOP/s by GPU name, from the vendors' data sheets: bf16/fp16 tensor
# cores, TF32 tensor cores, plain fp32. Matched in order against torch.cuda.get_device_name().
PEAK_FLOPS: list[tuple[str, dict[str, float]]] = [
    ("H200", {"bf16": 989e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    ("H100 PCIe", {"bf16": 756e12, "tf32": 378e12, "fp32": 51.2e12}),
    ("H100", {"bf16": 989e12, "tf32": 494.7e12, "fp32": 66.9e12}),  # SXM
    ("A100", {"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    ("L40S", {"bf16": 362e12, "tf32": 183e12, "fp32": 91.6e12}),
    ("L4", {"bf16": 121e12, "tf32": 60e12, "fp32": 30.3e12}),
    ("A10", {"bf16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12}),
    ("RTX 4090", {"bf16": 165.2e12, "tf32": 82.6e12, "fp32": 82.6e12}),
    # fp16 tensor cores; no bf16 or TF32
    ("V100", {"bf16": 125e12, "tf32": 15.7e12, "fp32": 15.7e12}),
]
_MEASURE_S = 0.1  # the CPU peak's matmuls: the best of about this long
_MEASURE_N = 256


# A model whose forward reads its inputs' values (a Hugging Face attention mask checked for padding)
# cannot run on the meta device; the FLOP count and train.py --check then build it for real on the
# CPU, up to this many parameters (1 GiB in float32), and run one real batch.
CPU_FALLBACK_PARAMETERS = 2**28


class Buildable(Protocol):
    """The model two ways (blueprint.Blueprint): on the meta device, and for real on the CPU."""

    def on_meta(self) -> torch.nn.Module: ...

    def for_real(self) -> torch.nn.Module: ...


def run_shapes_only(build: Buildable, fn: Any, meta_batch: Any, real_batch: Any) -> Any:
    """fn(model, batch) with the model built on the meta device (no memory, any size) and the
    batch's shapes; for a model whose forward reads its inputs' values, with the model built on the
    CPU and `real_batch` (None: the meta error stands; a meta_batch of None goes to the CPU at
    once). Raises what fn raises."""
    model = build.on_meta()
    if meta_batch is not None:
        try:
            return fn(model, meta_batch)
        except (RuntimeError, NotImplementedError) as error:
            if "meta" not in str(error) or real_batch is None:
                raise
    parameters = sum(p.numel() for p in model.parameters())
    if parameters > CPU_FALLBACK_PARAMETERS:
        raise RuntimeError(
            f"its forward reads its inputs' values, and at {parameters:,} parameters "
            "it is too large to run on the CPU instead of the meta device"
        )
    return fn(build.for_real(), real_batch)


def count(
    build: Buildable,
    loss: Callable[[Any, Any], torch.Tensor],
    batch: Any,
    real_batch: Any = None,
) -> int:
    """FLOPs of one forward and backward of the model on a batch, through `loss(model, batch)`: on
    the meta device (shapes and dtypes only; None: skipped), or for a model whose forward reads its
    inputs' values, built on the CPU and run on `real_batch` (run_shapes_only)."""
    from torch.utils.flop_counter import FlopCounterMode

    def counted(model: torch.nn.Module, inputs: Any) -> int:
        with FlopCounterMode(display=False) as counter:
            loss(model, inputs).backward()
        return int(counter.get_total_flops())

    return run_shapes_only(build, counted, batch, real_batch)


def gpu_peak(name: str, precision: str, tf32: bool) -> Optional[tuple[float, str]]:
    """(peak FLOP/s, where it is from) for a GPU named `name` at trainer.precision, if in the
    table."""
    kind = "bf16" if precision in ("bf16", "16") else ("tf32" if tf32 else "fp32")
    for key, peaks in PEAK_FLOPS:
        if key in name:
            return peaks[kind], f"{key} {kind} data-sheet peak"
    return None


def measure_cpu_peak(
    dtype: torch.dtype = torch.float32, seconds: float = _MEASURE_S, n: int = _MEASURE_N
) -> float:
    """FLOP/s of an n×n matmul in this process at its threads: the best of short repeats."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    torch.mm(a, b, out=out)  # warm-up: the kernel's choice, the caches
    best, repeats, deadline = 0.0, 4, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        started = time.perf_counter()
        for _ in range(repeats):
            torch.mm(a, b, out=out)
        best = max(best, repeats * 2 * n**3 / (time.perf_counter() - started))
    return best


def peak(
    device: torch.device, precision: str, threads: int, override: Optional[float]
) -> tuple[Optional[float], str]:
    """One device's (one rank's) peak FLOP/s and where it is from; (None, why) when unknown."""
    if override:
        return float(override), "trainer.peak_flops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        found = gpu_peak(name, precision, torch.backends.cuda.matmul.allow_tf32)
        return (
            found
            if found
            else (None, f"{name} is not in reporting/flops.py's table: set trainer.peak_flops")
        )
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    dtype_name = "bf16" if precision == "bf16" else "fp32"
    return measure_cpu_peak(
        dtype
    ), f"measured: {dtype_name} {_MEASURE_N}×{_MEASURE_N} matmul, {threads} thread(s) per rank"


def report(
    flops_per_sample: Optional[float],
    samples_per_sec: Optional[float],
    world_size: int,
    peak_flops: Optional[float],
    source: str,
) -> dict[str, Any]:
    """The summary's `flops`: per sample, achieved per rank (the mean: model FLOPs ÷ ranks), MFU."""
    per_rank = (
        flops_per_sample * samples_per_sec / world_size
        if flops_per_sample is not None and samples_per_sec
        else None
    )
    return {
        "per_sample": flops_per_sample,
        "per_sec_per_rank": per_rank,
        "peak_per_rank": peak_flops,
        "peak_source": source,
        "mfu": per_rank / peak_flops if per_rank is not None and peak_flops else None,
    }


def si(value: float, unit: str = "FLOP") -> str:
    """1.23 GFLOP, 4.5 TFLOP/s…"""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def line(flops: dict[str, Any]) -> Optional[str]:
    """The summary's row: achieved FLOP/s per rank and the MFU against its peak."""
    if not flops.get("per_sec_per_rank"):
        return None
    text = (
        f"{si(flops['per_sec_per_rank'], 'FLOP/s')} per rank "
        f"({si(flops['per_sample'])} per sample, forward and backward)"
    )
    if flops.get("mfu") is not None:
        return (
            f"{text}; MFU {flops['mfu']:.3f} of "
            f"{si(flops['peak_per_rank'], 'FLOP/s')} ({flops['peak_source']})"
        )
    return f"{text}; no MFU: {flops['peak_source']}"


def measure(
    build: Buildable,
    loss: Callable[..., Any],
    batch: Any,
    samples: int,
    sample: Any,
    samples_per_sec: Optional[float],
    precision: str,
    peak_flops: Optional[float],
    world_size: int,
    device: torch.device,
) -> dict[str, Any]:
    """A run's model FLOPs per sample (the first batch, of `samples` samples, on the meta device:
    `loss(model, batch)`; or its first `sample`, real, for a model that reads its inputs' values)
    and its MFU, on every rank alike."""
    from hydra_ddp.parallel import distributed

    per_sample = None
    if batch is not None and samples:
        try:
            try:
                per_sample = count(build, loss, batch) / samples
            except (RuntimeError, NotImplementedError) as error:
                if "meta" not in str(error) or sample is None:
                    raise
                per_sample = count(build, loss, None, sample)  # one real sample, on the CPU
        except Exception as e:  # noqa: BLE001  (a model that cannot be built or run on the meta device)
            log.warning(
                "no FLOP count: the model does not run on the meta device (%s: %s)",
                type(e).__name__,
                e,
            )
    value, source = peak(device, precision, torch.get_num_threads(), peak_flops)
    if value is not None and source.startswith("measured"):  # every rank measured at once: the best
        value = distributed.max_over_ranks(value, device)
    return report(per_sample, samples_per_sec, world_size, value, source)
