"""+experiment=text_gpt's recipe against the one it replaced, trained side by side on this machine:
the test loss and accuracy of each (one seed: a sketch of the effect, not a study).

    python bench/text_gpt_recipe.py     # → bench/results/text_gpt_recipe_<commit>.json

- recipe: the experiment as it stands (a 5 % warmup and a per-step cosine to a tenth, peak rate
  0.006, AdamW betas (0.9, 0.95), no decay on biases, norms and embeddings);
- recipe_at_0.003: the recipe at the old peak rate;
- before: the same with the settings it had before (a per-epoch cosine to zero, rate 0.003,
  betas (0.9, 0.999), decay on every parameter);
- wsd: docs/transformer.md's example, the recipe with warmup-stable-decay instead of the cosine
  (the peak rate held to the last 20 %, then a linear decay to the same tenth);
- ema_0.99, ema_0.9: the page's EMA example, and an average over about 10 steps instead of 100;
- recipe_seed1, wsd_seed1: the two schedules at another seed, for the size of one seed's noise.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import provenance

REPO = Path(__file__).resolve().parents[1]
RUNS = {
    "recipe": [],
    "recipe_at_0.003": ["optim.lr=0.003"],  # the schedule and groups at the old rate
    "before": [
        "scheduler=cosine",
        "~scheduler.warmup_ratio",
        "~scheduler.min_lr_ratio",
        "optim.lr=0.003",
        "optim.betas=[0.9,0.999]",
        "param_groups.no_decay=none",
    ],
    "wsd": ["scheduler=wsd", "scheduler.decay_ratio=0.2"],
    "ema_0.99": ["trainer.ema.decay=0.99"],
    "ema_0.9": ["trainer.ema.decay=0.9"],
    "recipe_seed1": ["trainer.seed=1"],
    "wsd_seed1": ["scheduler=wsd", "scheduler.decay_ratio=0.2", "trainer.seed=1"],
}


def main() -> int:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in RUNS.items():
            run_dir = Path(tmp) / name
            command = [
                sys.executable,
                "train.py",
                "+experiment=text_gpt",
                *overrides,
                f"hydra.run.dir={run_dir}",
            ]
            subprocess.run(command, cwd=REPO, check=True, capture_output=True)
            summary = json.loads((run_dir / "summary.json").read_text())
            results[name] = {
                "overrides": overrides,
                **{
                    key: summary[key]
                    for key in ("steps", "test_loss", "test_accuracy", "test_perplexity")
                },
            }
            print(
                f"{name}: test loss {summary['test_loss']:.4f}, "
                f"accuracy {summary['test_accuracy']:.4f}",
                flush=True,
            )
    result = {
        **provenance.header(),
        "workload": "+experiment=text_gpt, 2 gloo ranks on the "
        "CPU, 4 epochs, seed 0 (but the *_seed1 runs)",
        "runs": results,
    }
    out = REPO / "bench" / "results" / f"text_gpt_recipe_{result['commit']}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"→ {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
