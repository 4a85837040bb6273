"""The project on CUDA, in one prepared run (under 5 minutes on one GPU): run by bench/gpu_check.sh.

Prints, and writes to OUT/gpu_check.md:
- parity: train.py against bench/handwritten.py (the seeds' CNN, batch 64, nccl, one rank per GPU),
  and `auto` leaving the CPU-only ddp.shared_memory off;
- the defaults on CUDA: the CNN with every `auto` setting off, with workers started as fresh
  interpreters (start_method=spawn: the forkserver must not have touched CUDA), with the fp16
  and bf16 communication hooks, with fp16 autocast and gradient clipping (GradScaler's unscale);
- ResNet-50 (torchvision) images/s in bf16 on synthetic 224×224 data: auto settings off, the
  defaults (channels_last, bucket view, static graph), and torch.compile;
- the transformer (+experiment=text_gpt) under ddp, fsdp and tp, with sharded checkpoints;
- the tuner (python -m hydra_ddp.tune) on the CNN, precision and pin_memory among its knobs;
- DataParallel against DDP where 2 or more GPUs exist (the seeds say DDP is faster);
- where 2 or more GPUs exist: a BatchNorm model (ResNet-18) with ddp.sync_batchnorm and
  data.global_batch_size trains alike on 1 GPU and on all of them (step losses compared).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
OUT = Path(os.environ.get("OUT", REPO / "bench" / "results"))
FIELDS = ("steady_samples_per_sec", "median_step_time_s", "time_to_first_step_s", "peak_rss_mb")
AUTO_OFF = ("trainer.channels_last=false", "ddp.gradient_as_bucket_view=false", "ddp.static_graph=false",
            "ddp.shared_memory=false")  # the last is CPU-only: auto leaves it off on CUDA anyway
COMMON = ("data=synthetic", "trainer.epochs=1000", "trainer.progress=false", "checkpoint.every_epoch=false",
          "data.dataset.test_size=256")


def run(cmd: list[str], result: Path, timeout: float) -> dict:
    started = time.time()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    figures = json.loads(result.read_text())
    figures["time_to_first_step_s"] = figures["first_step_at"] - started
    return figures


def project(overrides: list[str], steps: int, batch: int, timeout: float = 240) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "train.py", *COMMON, f"trainer.max_steps={steps}", f"data.batch_size={batch}",
               f"data.dataset.train_size={steps * batch * torch.cuda.device_count()}", *overrides,
               f"hydra.run.dir={tmp}/run"]
        return run(cmd, Path(tmp) / "run" / "summary.json", timeout)


def gpt(overrides: list[str], steps: int, timeout: float = 300) -> dict:
    """The transformer on Python's source, a global batch of 64 sequences, a sharded (DCP) checkpoint every 20 steps."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "train.py", "+experiment=text_gpt", "trainer.epochs=1000", "trainer.progress=false",
               f"trainer.max_steps={steps}", "data.global_batch_size=64", f"data.dataset.max_bytes={steps * 64 * 65 * 2}",
               "checkpoint.every_epoch=false", "checkpoint.every_n_steps=20", *overrides, f"hydra.run.dir={tmp}/run"]
        return run(cmd, Path(tmp) / "run" / "summary.json", timeout)


def step_losses(overrides: list[str], steps: int) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "train.py", *COMMON, f"trainer.max_steps={steps}", "trainer.log_every=5",
               "data.dataset.train_size=4096", "data.drop_last=true", *overrides, f"hydra.run.dir={tmp}/run"]
        run(cmd, Path(tmp) / "run" / "summary.json", 300)
        acc = EventAccumulator(f"{tmp}/run/tensorboard", size_guidance={"scalars": 0})
        acc.Reload()
        return [e.value for e in acc.Scalars("train/loss")]


def handwritten(steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "bench/handwritten.py", "--device", "cuda", "--nproc", str(torch.cuda.device_count()),
               "--steps", str(steps), f"{tmp}/result.json"]
        return run(cmd, Path(tmp) / "result.json", 240)


def row(label: str, f: dict) -> str:
    return (f"| {label} | {f['steady_samples_per_sec']:,.0f} | {f['median_step_time_s'] * 1000:.2f} | "
            f"{f['time_to_first_step_s']:.1f} | {f['peak_rss_mb']:.0f} |")


def main() -> None:
    gpus = torch.cuda.device_count()
    lines = [
        f"# GPU check: {torch.cuda.get_device_name(0)} × {gpus}, torch {torch.__version__}, "
        f"{os.cpu_count()} CPU cores",
        "",
        "Absolute figures vary between machines; compare the ratios.",
        "",
        "| run | samples/s (steady) | median step ms | first step s | peak RSS MB |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]

    def emit(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    print("\n".join(lines), flush=True)
    # Parity: the seeds' CNN, batch 64 per GPU, interleaved A B A B.
    hand, proj = [], []
    for _ in range(2):
        hand.append(handwritten(300))
        emit(row("hand-written CNN (nccl)", hand[-1]))
        proj.append(project([], 300, 64))
        emit(row("project CNN (train.py, nccl)", proj[-1]))
    ratio = statistics.median(p["steady_samples_per_sec"] for p in proj) / statistics.median(
        h["steady_samples_per_sec"] for h in hand)
    chosen = proj[-1].get("settings", {})
    if chosen.get("ddp.shared_memory"):  # it sums CPU tensors: auto must leave it off on CUDA
        raise RuntimeError(f"the default run chose ddp.shared_memory on CUDA: {chosen}")
    # The defaults on CUDA: each auto setting off, workers as fresh interpreters, the 16-bit hooks.
    variants = {}
    for label, extra in [
        ("project CNN, auto settings off", list(AUTO_OFF)),
        ("project CNN, start_method=spawn", ["launcher.start_method=spawn"]),
        ("project CNN, comm_hook=fp16", ["ddp.comm_hook=fp16"]),
        ("project CNN, comm_hook=bf16", ["ddp.comm_hook=bf16"]),
        # GradScaler's unscale before clipping runs only on the GPU (fp16): it must train and log.
        ("project CNN, fp16 + grad_clip=1", ["trainer.precision=16", "trainer.grad_clip=1.0"]),
        # FSDP2 on CUDA (never run on a GPU yet): sharded, and with its bf16 mixed precision.
        ("project CNN, strategy=fsdp", ["strategy=fsdp"]),
        ("project CNN, strategy=fsdp, mixed_precision=bf16 + grad_clip=1",
         ["strategy=fsdp", "strategy.mixed_precision=bf16", "trainer.grad_clip=1.0"]),
    ]:
        variants[label] = project(extra, 300, 64)
        emit(row(label, variants[label]))
    # The transformer under each strategy (tensor parallel over every GPU; with one, a one-rank mesh):
    # DTensor, DCP checkpoints and the global-norm clipping on CUDA, never run on a GPU yet.
    for name in ("ddp", "fsdp", "tp"):
        label = f"project GPT, strategy={name}"
        variants[label] = gpt([f"strategy={name}"], 100)
        emit(row(label, variants[label]) + f" model state/rank {variants[label]['model_state_bytes']['total'] / 2**20:.2f} MB")
    # ResNet-50, bf16, synthetic 224×224 held on the GPU.
    resnet = ["model=torchvision", "model.name=resnet50", "data.in_channels=3", "data.image_size=224",
              "data.num_classes=1000", "trainer.precision=bf16", "data.preload=true", "data.eval_batch_size=128"]
    results = {}
    for label, extra in [
        ("ResNet-50 bf16, auto settings off", list(AUTO_OFF)),
        ("ResNet-50 bf16 (defaults: channels_last, bucket view, static graph)", []),
        ("ResNet-50 bf16 + torch.compile", ["trainer.compile=true"]),
    ]:
        results[label] = project(resnet + extra, 40, 128, timeout=400)
        emit(row(label, results[label]))
    base = results["ResNet-50 bf16, auto settings off"]["steady_samples_per_sec"]
    emit("")
    emit(f"**Parity (project / hand-written, steady samples/s, median of 2): {ratio:.3f}×**")
    cnn = statistics.median(p["steady_samples_per_sec"] for p in proj)
    for label, f in variants.items():
        if "GPT" in label:  # sequences, not images: against the GPT's ddp row
            f_ddp = variants["project GPT, strategy=ddp"]
            emit(f"- {label}: {f['steady_samples_per_sec'] / f_ddp['steady_samples_per_sec']:.2f}× ddp's sequences/s, "
                 f"{f['model_state_bytes']['total'] / f_ddp['model_state_bytes']['total']:.2f}× its model state per rank")
            continue
        emit(f"- {label}: {f['steady_samples_per_sec'] / cnn:.2f}× the defaults' samples/s, first step "
             f"{f['time_to_first_step_s'] - statistics.median(p['time_to_first_step_s'] for p in proj):+.1f} s")
    for label, f in results.items():
        emit(f"- {label}: {f['steady_samples_per_sec']:,.0f} images/s ({f['steady_samples_per_sec'] / base:.2f}× auto off)")
    # The tuner on CUDA, where pin_memory and bf16/fp16 join its knobs: its last line, the fastest overrides.
    tuned = subprocess.run([sys.executable, "-m", "hydra_ddp.tune", *COMMON, "data.batch_size=64",
                            "tune.precision=true", "tune.steps=50"], cwd=REPO, capture_output=True, text=True, timeout=300)
    emit(f"- tuner (python -m hydra_ddp.tune tune.precision=true, the CNN): "
         f"{(tuned.stdout.strip().splitlines() or ['no output'])[-1] if tuned.returncode == 0 else tuned.stderr[-500:]}")
    if gpus < 2:
        emit("- DataParallel vs DDP: not measured (one GPU here; needs 2 or more)")
        emit("- SyncBatchNorm world-size invariance: not measured (one GPU here; needs 2 or more)")
    else:
        bn = ["model=resnet18", "data.in_channels=1", "ddp.sync_batchnorm=true", "data.global_batch_size=128"]
        one, many = step_losses(bn + ["trainer.nproc=1"], 20), step_losses(bn + [f"trainer.nproc={gpus}"], 20)
        worst = max(abs(a - b) / abs(b) for a, b in zip(many, one))
        emit(f"- ResNet-18 + SyncBatchNorm, global batch 128, 1 vs {gpus} GPUs: largest relative step-loss "
             f"difference over 20 steps {worst:.1e} (fp32; TF32 matmuls may widen it)")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "gpu_check.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
