"""The transformers experiment (+experiment=hf_llama) against the same model trained by a plain
hand-written DDP loop with the same settings, side by side in one run.

The hand-written loop is what a Hugging Face user writes without a framework: mp.spawn, a gloo
process group, DistributedSampler, DDP around the same `transformers` Llama (built from the same
config by the same function, so the same weights), AdamW (lr 0.003, weight decay 0.1), gradient
clipping at 1.0, `model(**batch).loss`, batch 32 per rank on the same dict samples, one thread per
rank. Both run `--steps` optimizer steps; samples/s is over the steps after the first `--warm`.
The two are run back to back, `--repeats` times, alternating which goes first: the host's speed
drifts within the hour, so only the paired ratios compare.

    python bench/transformers_loop.py --steps 60 --repeats 3
    # → bench/results/transformers_<commit>.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import provenance
from omegaconf import OmegaConf

from handwritten import ddp_setup, spawned

REPO = Path(__file__).resolve().parents[1]
# The experiment's model: conf/model/hf_llama.yaml's fields, its vocabulary data=text_dicts'.
LLAMA = {
    key: value
    for key, value in OmegaConf.to_container(
        OmegaConf.load(REPO / "conf" / "model" / "hf_llama.yaml")
    ).items()
    if key not in ("_target_", "vocab_size")  # its vocabulary is an interpolation of the data's
} | {"vocab_size": OmegaConf.load(REPO / "conf" / "data" / "text_dicts.yaml").num_classes}
BATCH, NPROC = 32, 2


def _worker(rank: int, port: int, steps: int, warm: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    from hydra_ddp.data import python_source_dicts
    from hydra_ddp.hf import causal_lm

    torch.set_num_threads(1)
    ddp_setup(rank, NPROC, port, torch.device("cpu"))  # gloo, on this host
    torch.manual_seed(0)
    model = DDP(causal_lm(**LLAMA))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.003, weight_decay=0.1)
    train, _ = python_source_dicts()
    sampler = DistributedSampler(train, num_replicas=NPROC, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=BATCH, sampler=sampler, drop_last=True)
    times, done, epoch = [], 0, 0
    while done < steps:
        sampler.set_epoch(epoch)
        last = time.perf_counter()
        for batch in loader:
            loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss.item()  # as the project reads its loss every step
            now = time.perf_counter()
            times.append(now - last)
            last, done = now, done + 1
            if done == steps:
                break
        epoch += 1
    if rank == 0:
        steady = times[warm:]
        Path(out).write_text(
            json.dumps({"samples_per_sec": BATCH * NPROC * len(steady) / sum(steady)})
        )
    dist.destroy_process_group()


def handwritten(steps: int, warm: int) -> float:
    return spawned(_worker, NPROC, steps, warm)["samples_per_sec"]


def project(steps: int) -> float:
    with tempfile.TemporaryDirectory() as run_dir:
        subprocess.run(
            [sys.executable, str(REPO / "train.py"), "+experiment=hf_llama",
             f"trainer.max_steps={steps}", "trainer.epochs=100", "data.val_fraction=0",
             f"hydra.run.dir={run_dir}"],
            cwd=REPO, check=True, capture_output=True, text=True,
        )  # fmt: skip
        summary = json.loads(Path(run_dir, "summary.json").read_text())
        return summary["steady_samples_per_sec"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument(
        "--warm",
        type=int,
        default=5,
        help="the hand loop's first steps left out (the project: its own)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    pairs = []
    for repeat in range(args.repeats):
        order = ["project", "handwritten"] if repeat % 2 == 0 else ["handwritten", "project"]
        got = {}
        for name in order:
            got[name] = (
                project(args.steps) if name == "project" else handwritten(args.steps, args.warm)
            )
        pairs.append({**got, "ratio": got["project"] / got["handwritten"], "first": order[0]})
        print(f"repeat {repeat + 1}: project {got['project']:.0f}, handwritten "
            f"{got['handwritten']:.0f} samples/s, ratio {pairs[-1]['ratio']:.3f}",
            flush=True)  # fmt: skip
    ratios = [p["ratio"] for p in pairs]
    result = {
        **provenance.header(),
        "workload": f"+experiment=hf_llama (Llama {LLAMA}), batch {BATCH}/rank, "
        f"{NPROC} gloo ranks, 1 thread each, {args.steps} steps",
        "pairs": pairs,
        "median_ratio": statistics.median(ratios),
        "ratio_range": [min(ratios), max(ratios)],
    }
    out = REPO / "bench" / "results" / f"transformers_{result['commit']}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"project / hand-written DDP loop: median {result['median_ratio']:.3f} "
          f"({min(ratios):.3f}-{max(ratios):.3f}) → {out.relative_to(REPO)}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
