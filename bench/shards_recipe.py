"""docs/language_models.md's shards recipe, trained as the page says, beside the documents
experiment it mirrors: the same documents, tokenizer, optimizer, schedule and length, read from
shards on disk (padded per batch) or from memory (packed). Each run's time, steps and perplexity.

    python bench/shards_recipe.py     # → bench/results/shards_recipe_<commit>.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import provenance

REPO = Path(__file__).resolve().parents[1]
WRITE = ["--source", "documents", "--arg", "context=128", "--arg", "max_bytes=262144"]


def _train(run_dir: Path, *overrides: str) -> dict:
    began = time.perf_counter()
    subprocess.run(
        [sys.executable, "train.py", *overrides, f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    seconds = time.perf_counter() - began
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "overrides": list(overrides),
        "command_s": round(seconds, 1),
        **{
            key: summary[key]
            for key in ("steps", "wall_time_s", "test_loss", "test_perplexity", "val_loss")
        },
    }


def main() -> int:
    commit, dirty = provenance.commit()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        shards = Path(tmp) / "shards"
        subprocess.run(
            [sys.executable, "-m", "hydra_ddp.tools.shards", "write", str(shards), *WRITE],
            cwd=REPO,
            check=True,
            capture_output=True,
        )
        runs = {
            "shards_gpt": ("+experiment=shards_gpt", f"data.dataset.root={shards}"),
            "documents_gpt": ("+experiment=documents_gpt",),
        }
        for name, overrides in runs.items():
            results[name] = _train(Path(tmp) / name, *overrides)
            print(name, results[name], flush=True)
    result = {
        "commit": commit,
        "dirty": dirty,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": f"{os.cpu_count()} × {provenance.cpu_model()}",
        "workload": "the shard tool's documents (context 128, 256 KiB of the standard library), "
        "then +experiment=shards_gpt; +experiment=documents_gpt on the same documents packed; "
        "2 gloo ranks on the CPU, 4 epochs, seed 0",
        "runs": results,
    }
    out = REPO / "bench" / "results" / f"shards_recipe_{commit[:7]}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"→ {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
