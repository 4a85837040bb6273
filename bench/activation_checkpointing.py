"""Activation checkpointing's effect: the bytes autograd keeps for the backward, and the step time,
of the project's GPT at a context long enough for activations to matter, with
strategy.activation_checkpointing none, every_k (k = 2) and full, side by side in one process.

    python bench/activation_checkpointing.py
    # → bench/results/activation_checkpointing_<commit>.json

The bytes are every tensor autograd saves during the forward
(torch.autograd.graph.saved_tensors_hooks), the parameters included; with checkpointing a block
keeps its inputs and recomputes the rest in the backward. The time is forward + backward + an AdamW
step, at 1 thread, the modes interleaved repeat by repeat (the machine's drift falls on all of them
alike); the median per mode."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import provenance
import torch
import torch.nn.functional as F

from hydra_ddp.models import TinyGPT
from hydra_ddp.recipe import activation_checkpointing

REPO = Path(__file__).resolve().parents[1]
MODES = ("none", "every_k", "full")


def build(mode: str, context: int, dim: int, depth: int) -> tuple[TinyGPT, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=256, context=context, dim=dim, depth=depth, heads=4)
    settings = SimpleNamespace(activation_checkpointing=mode, activation_checkpointing_every=2)
    activation_checkpointing.apply(model, settings)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def saved_bytes(model: TinyGPT, tokens: torch.Tensor) -> tuple[int, torch.Tensor]:
    """The bytes saved for the backward during one forward, and its loss."""
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(model(tokens), tokens)
    return total[0], loss


def step_time(model: TinyGPT, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> float:
    started = time.perf_counter()
    loss = F.cross_entropy(model(tokens), tokens)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument(
        "--steps", type=int, default=8, help="timed steps per mode and repeat (after 2 unmeasured)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokens = torch.randint(
        0, 256, (args.batch, args.context), generator=torch.Generator().manual_seed(0)
    )
    runs = {mode: build(mode, args.context, args.dim, args.depth) for mode in MODES}
    measured = {mode: saved_bytes(runs[mode][0], tokens) for mode in MODES}
    losses_equal = all(torch.equal(measured[mode][1], measured["none"][1]) for mode in MODES)
    for model, _ in runs.values():
        model.zero_grad(set_to_none=True)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for repeat in range(args.repeats):
        for mode in MODES if repeat % 2 == 0 else reversed(MODES):
            model, optimizer = runs[mode]
            for _ in range(2):
                step_time(model, optimizer, tokens)
            times[mode] += [step_time(model, optimizer, tokens) for _ in range(args.steps)]
    base_bytes, base_time = measured["none"][0], statistics.median(times["none"])
    result = {
        **provenance.header(),
        "workload": f"TinyGPT dim {args.dim}, depth {args.depth}, 4 heads, context {args.context}, "
        f"batch {args.batch}, fp32, 1 CPU thread; forward + backward + AdamW step",
        "first_losses_equal": losses_equal,
        "modes": {
            mode: {
                "saved_bytes": measured[mode][0],
                "saved_vs_none": measured[mode][0] / base_bytes,
                "step_s_median": statistics.median(times[mode]),
                "step_vs_none": statistics.median(times[mode]) / base_time,
                "step_s": times[mode],
            }
            for mode in MODES
        },
    }
    out = REPO / "bench" / "results" / f"activation_checkpointing_{result['commit']}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    for mode, got in result["modes"].items():
        print(f"{mode:8s} saved {got['saved_bytes'] / 2**20:7.1f} MiB "
            f"({got['saved_vs_none']:.2f}x), step "
            f"{got['step_s_median'] * 1000:6.1f} ms ({got['step_vs_none']:.2f}x)")  # fmt: skip
    print(f"losses equal: {losses_equal} → {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
