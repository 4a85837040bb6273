"""Language models on documents, measured side by side in one run (each pair back to back, the
order alternating: the host's speed drifts within the hour, so only paired ratios compare).

1. The packed experiment (+experiment=documents_gpt) against a plain hand-written DDP loop of the
   same model on the same packed windows, weighing its loss the same way (each step's token count
   all-reduced, the loss summed and divided by it): mp.spawn, gloo, DistributedSampler, DDP, AdamW
   (lr 0.003, betas 0.9/0.95, weight decay 0.1), clipping at 1.0, 16 windows per rank, one thread.
2. Padding against packing in the project: the same documents padded per batch (with and without
   data.group_by_length) and packed; trained tokens/s (the tokens the loss counts) and the share of
   the batches' positions that are padding (from the epoch's own batches at 2 ranks).
3. What weighing by tokens costs: the packed experiment as it is (a count all-reduced each step)
   against the same run weighing each micro-batch's mean alike (no count: samples/s).

    python bench/language_model.py --steps 40 --repeats 3
    # → bench/results/language_model_<commit>.json
"""

from __future__ import annotations

import argparse
import json
import os
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
EXPERIMENT = OmegaConf.load(REPO / "conf" / "experiment" / "documents_gpt.yaml")
CONTEXT, MAX_BYTES = EXPERIMENT.data.dataset.context, EXPERIMENT.data.dataset.max_bytes
# conf/model/gpt.yaml's fields, its vocabulary and context (interpolations of the data's) as
# data=documents' are.
GPT = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "model" / "gpt.yaml"), resolve=False)
GPT = {k: v for k, v in GPT.items() if k != "_target_"} | {
    "vocab_size": OmegaConf.load(REPO / "conf" / "data" / "documents.yaml").dataset.vocab_size,
    "context": CONTEXT,
}
NPROC = 2
BATCH = EXPERIMENT.data.global_batch_size // NPROC  # windows per rank
# The project's settings for each of part 2's ways, and part 3's samples-weighted task
# (bench/weighting.py).
WAYS = {
    "packed": ("data.dataset.packing=true",),
    "padded": ("data.dataset.packing=false",),
    "padded, grouped by length": ("data.dataset.packing=false", "data.group_by_length=8"),
}
PER_BATCH_MEAN = ("task._target_=weighting.MeanPerBatch",)


def _worker(rank: int, port: int, steps: int, warm: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    from hydra_ddp.data import documents
    from hydra_ddp.models import TinyGPT

    torch.set_num_threads(1)
    ddp_setup(rank, NPROC, port, torch.device("cpu"))  # gloo, on this host
    torch.manual_seed(0)
    model = DDP(TinyGPT(**GPT))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.003, betas=(0.9, 0.95), weight_decay=0.1)
    train, _ = documents(context=CONTEXT, packing=True, max_bytes=MAX_BYTES)
    sampler = DistributedSampler(train, num_replicas=NPROC, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=BATCH, sampler=sampler, drop_last=True)
    times, tokens, done, epoch = [], [], 0, 0
    while done < steps:
        sampler.set_epoch(epoch)
        last = time.perf_counter()
        for batch in loader:
            following = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
            count = (following != -100).sum()
            total = count.clone()
            dist.all_reduce(total)  # the step's tokens over the ranks: every token weighs alike
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
            loss = F.cross_entropy(logits.flatten(0, 1), following.flatten(), reduction="sum") / (
                total / NPROC
            )
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss.item()  # as the project reads its loss every step
            now = time.perf_counter()
            times.append(now - last)
            tokens.append(int(total))
            last, done = now, done + 1
            if done == steps:
                break
        epoch += 1
    if rank == 0:
        Path(out).write_text(json.dumps({"tokens_per_sec": sum(tokens[warm:]) / sum(times[warm:])}))
    dist.destroy_process_group()


def handwritten(steps: int, warm: int) -> float:
    return spawned(_worker, NPROC, steps, warm)["tokens_per_sec"]


def project(steps: int, *overrides: str) -> dict[str, float]:
    """The experiment's steady trained tokens/s and samples/s (the summary's steps after its
    warm-up)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(REPO / "bench"), os.environ.get("PYTHONPATH")])
        ),
    }
    with tempfile.TemporaryDirectory() as run_dir:
        subprocess.run(
            [sys.executable, str(REPO / "train.py"), "+experiment=documents_gpt",
             f"trainer.max_steps={steps}", "trainer.epochs=100", "data.val_fraction=0",
             *overrides, f"hydra.run.dir={run_dir}"],
            cwd=REPO, check=True, capture_output=True, text=True, env=env,
        )  # fmt: skip
        s = json.loads(Path(run_dir, "summary.json").read_text())
    tokens_per_sample = s["tokens_per_step"] / s["global_batch_size"]
    return {
        "tokens_per_sec": s["steady_samples_per_sec"] * tokens_per_sample,
        "samples_per_sec": s["steady_samples_per_sec"],
    }


def padding_share(*overrides: str) -> float:
    """The share of an epoch's batch positions that are padding, at 2 ranks of BATCH (the epoch's
    own order, as the run's sampler gives it)."""
    import torch

    from hydra_ddp.data import ResumableDistributedSampler, documents

    packing = "data.dataset.packing=true" in overrides
    train, _ = documents(context=CONTEXT, packing=packing, max_bytes=MAX_BYTES)
    if packing:
        # the padding id: windows' unfilled ends
        return float((train.tree["input_ids"] == 1).float().mean())
    grouped = next(
        (int(o.split("=")[1]) for o in overrides if o.startswith("data.group_by_length=")), None
    )
    by_length = (train.lengths, BATCH * NPROC, grouped) if grouped else None
    padded = real = 0
    for rank in range(NPROC):
        sampler = ResumableDistributedSampler(
            train, num_replicas=NPROC, rank=rank, shuffle=True, seed=0, by_length=by_length
        )
        sampler.set_epoch(0)
        lengths = train.lengths[torch.tensor(list(sampler))]
        for batch in lengths.split(BATCH):
            padded += int(batch.max()) * len(batch)
            real += int(batch.sum())
    return 1 - real / padded


def paired(a, b, repeats: int) -> list[dict]:
    """`repeats` pairs of (a(), b()), back to back, alternating which goes first."""
    pairs = []
    for repeat in range(repeats):
        first, second = (a, b) if repeat % 2 == 0 else (b, a)
        got = {first.__name__: first(), second.__name__: second()}
        pairs.append({**got, "first": first.__name__})
    return pairs


def summary(ratios: list[float]) -> dict:
    return {"median": statistics.median(ratios), "range": [min(ratios), max(ratios)]}


def against_handwritten(args: argparse.Namespace) -> dict:
    """1. The project against the hand-written loop: trained tokens/s."""

    def project_packed() -> float:
        return project(args.steps)["tokens_per_sec"]

    def handwritten_loop() -> float:
        return handwritten(args.steps, args.warm)

    pairs = paired(project_packed, handwritten_loop, args.repeats)
    ratio = summary([p["project_packed"] / p["handwritten_loop"] for p in pairs])
    print(f"1. project / hand-written loop, tokens/s: {ratio}", flush=True)
    return {"vs_handwritten": {"pairs": pairs, "ratio": ratio}}


def padding_against_packing(args: argparse.Namespace) -> dict:
    """2. Padding against packing: trained tokens/s (each way paired with packing) and padding."""

    def packed() -> dict:
        return project(args.steps, *WAYS["packed"])

    ways: dict = {"packed": {"padding_share": padding_share(*WAYS["packed"])}}
    for way, overrides in list(WAYS.items())[1:]:

        def this_way(overrides=overrides) -> dict:
            return project(args.steps, *overrides)

        pairs = paired(this_way, packed, args.repeats)
        ratio = summary(
            [p["this_way"]["tokens_per_sec"] / p["packed"]["tokens_per_sec"] for p in pairs]
        )
        ways[way] = {
            "padding_share": padding_share(*overrides),
            "pairs": pairs,
            "tokens_per_sec_vs_packed": ratio,
        }
        print(
            f"2. {way}: {ways[way]['padding_share']:.3f} padding, tokens/s vs packed {ratio}",
            flush=True,
        )
    return {"ways": ways}


def token_weighting_cost(args: argparse.Namespace) -> dict:
    """3. Weighing by tokens (a count all-reduced per step) against each micro-batch's mean:
    samples/s."""

    def by_tokens() -> dict:
        return project(args.steps)

    def per_batch_mean() -> dict:
        return project(args.steps, *PER_BATCH_MEAN)

    pairs = paired(by_tokens, per_batch_mean, args.repeats)
    cost = summary(
        [p["by_tokens"]["samples_per_sec"] / p["per_batch_mean"]["samples_per_sec"] for p in pairs]
    )
    print(f"3. by tokens / per-batch mean, samples/s: {cost}", flush=True)
    return {"token_weighting_cost": {"pairs": pairs, "samples_per_sec_ratio": cost}}


PARTS = {1: against_handwritten, 2: padding_against_packing, 3: token_weighting_cost}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument(
        "--warm",
        type=int,
        default=5,
        help="the hand loop's first steps left out (the project: its own)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--parts",
        default="1,2,3",
        help="which of the three to measure (the result file's name says)",
    )
    args = parser.parse_args()
    parts = {int(part) for part in args.parts.split(",")}
    commit, dirty = provenance.commit()
    result: dict = {
        "commit": commit,
        "dirty": dirty,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": f"{os.cpu_count()} × {provenance.cpu_model()}",
        "workload": f"+experiment=documents_gpt (TinyGPT {GPT}, windows of "
        f"{CONTEXT} tokens, {BATCH} per rank), {NPROC} gloo ranks, "
        f"1 thread each, {args.steps} steps; data.val_fraction=0",
    }

    for part in sorted(parts):
        result.update(PARTS[part](args))
    which = "" if parts == set(PARTS) else "_part" + "".join(map(str, sorted(parts)))
    out = REPO / "bench" / "results" / f"language_model_{commit}{which}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"→ {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
