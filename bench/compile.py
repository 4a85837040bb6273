"""trainer.compile=true (each block compiled by inductor) against eager, for the GPT and the
transformers experiments on packed documents, paired; and what inductor's cache in the run directory
buys a resumed compiled run.

Each model: `--repeats` pairs of train.py runs, eager and compiled back to back (alternating which
goes first: the host's speed drifts), `--steps` optimizer steps at 2 gloo ranks of 1 thread, no
validation. Per run, from its summary: steady samples/s (the steps after the warm-up, which holds
the first compile), the median step time (a recompile for a shape seen later, e.g. the epoch's last
batch, is one slow step: the median leaves it out, samples/s does not) and the time to the first
step (from the command's start: the first compile's cost). Then a compiled run is resumed for 10
more steps twice: with its compile_cache/ (as trainer.resume=auto finds it) and without it.

    python bench/compile.py --steps 60 --repeats 3   # → bench/results/compile_<commit>.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import provenance
from language_model import summary  # a ratio's median and range

REPO = Path(__file__).resolve().parents[1]
MODELS = {"gpt": "+experiment=documents_gpt", "llama": "+experiment=documents_llama"}
COMMON = (
    "trainer.epochs=100",
    "data.val_fraction=0",
    "trainer.threads=1",
    "trainer.nproc=2",
    "trainer.progress=false",
)


def train(run_dir: Path, *overrides: str) -> dict:
    subprocess.run(
        [sys.executable, str(REPO / "train.py"), *COMMON, *overrides, f"hydra.run.dir={run_dir}"],
        cwd=REPO, check=True, capture_output=True, text=True, env=dict(os.environ),
    )  # fmt: skip
    s = json.loads((run_dir / "summary.json").read_text())
    return {
        "samples_per_sec": s["steady_samples_per_sec"],
        "median_step_s": s["median_step_time_s"],
        "first_step_s": s["time_to_first_step_s"],
        "compile": s["compile"],
    }


def paired(model: str, steps: int, repeats: int) -> dict:
    experiment = (MODELS[model], f"trainer.max_steps={steps}")
    pairs = []
    with tempfile.TemporaryDirectory() as work:
        for repeat in range(repeats):
            order = ("eager", "compiled") if repeat % 2 == 0 else ("compiled", "eager")
            got = {}
            for way in order:
                run_dir = Path(work) / f"{way}-{repeat}"
                got[way] = train(
                    run_dir,
                    *experiment,
                    f"trainer.compile={'true' if way == 'compiled' else 'false'}",
                )
            pairs.append({**got, "first": order[0]})
            print(f"{model} {repeat + 1}/{repeats}: {got}", flush=True)
    return {
        "pairs": pairs,
        "samples_per_sec_compiled_vs_eager": summary(
            [p["compiled"]["samples_per_sec"] / p["eager"]["samples_per_sec"] for p in pairs]
        ),
        "median_step_compiled_vs_eager": summary(
            [p["compiled"]["median_step_s"] / p["eager"]["median_step_s"] for p in pairs]
        ),
        "first_step_s_compiled_minus_eager": summary(
            [p["compiled"]["first_step_s"] - p["eager"]["first_step_s"] for p in pairs]
        ),
    }


def resumed(model: str, steps: int) -> dict:
    """A compiled run's first step, fresh and resumed with and without its cache (`steps`: unused
    here, the time budget ends each run)."""
    with tempfile.TemporaryDirectory() as work:
        run_dir = Path(work) / "run"
        # Ended by the time budget, so that the same command continues it: a run whose schedule is
        # shaped by its length is not continued at another length (docs/checkpoints.md).
        budget = ("trainer.max_steps=100000", "trainer.max_time=45")  # seconds
        first = train(run_dir, MODELS[model], *budget, "trainer.compile=true")
        cold = Path(work) / "cold"
        shutil.copytree(run_dir, cold)
        shutil.rmtree(cold / "compile_cache")
        more = (MODELS[model], *budget, "trainer.compile=true", "trainer.resume=auto")
        with_cache = train(run_dir, *more)
        without = train(cold, *more)
    return {
        "fresh_first_step_s": first["first_step_s"],
        "resumed_with_cache_first_step_s": with_cache["first_step_s"],
        "resumed_without_cache_first_step_s": without["first_step_s"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default="gpt,llama")
    args = parser.parse_args()
    result: dict = {
        **provenance.header(),
        "workload": f"{', '.join(MODELS[m] for m in args.models.split(','))}: packed "
        f"documents, 2 gloo ranks of 1 thread, {args.steps} steps, no "
        "validation; trainer.compile=true (each block, inductor) against eager",
    }
    for model in args.models.split(","):
        result[model] = {
            "paired": paired(model, args.steps, args.repeats),
            "resume": resumed(model, args.steps),
        }
        print(
            f"{model}: "
            f"{json.dumps({k: v for k, v in result[model]['paired'].items() if k != 'pairs'})}"
        )
        print(f"{model} resume: {result[model]['resume']}", flush=True)
    out = REPO / "bench" / "results" / f"compile_{result['commit']}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"→ {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
