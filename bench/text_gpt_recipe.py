"""+experiment=text_gpt's recipe against the one it replaced, trained side by side on this machine:
the test loss and accuracy of each (one seed: a sketch of the effect, not a study).

    python bench/text_gpt_recipe.py     # → bench/results/text_gpt_recipe_<commit>.json

- recipe: the experiment as it stands (a 5 % warmup and a per-step cosine to a tenth, peak rate
  0.006, AdamW betas (0.9, 0.95), no decay on biases, norms and embeddings);
- recipe_at_0.003: the recipe at the old peak rate;
- before: the same with the settings it had before (a per-epoch cosine to zero, rate 0.003,
  betas (0.9, 0.999), decay on every parameter).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
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
}


def main() -> int:
    commit, dirty = provenance.commit()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in RUNS.items():
            run_dir = Path(tmp) / name
            command = [sys.executable, "train.py", "+experiment=text_gpt", *overrides, f"hydra.run.dir={run_dir}"]
            subprocess.run(command, cwd=REPO, check=True, capture_output=True)
            summary = json.loads((run_dir / "summary.json").read_text())
            results[name] = {
                "overrides": overrides,
                **{key: summary[key] for key in ("steps", "test_loss", "test_accuracy", "test_perplexity")},
            }
            print(f"{name}: test loss {summary['test_loss']:.4f}, accuracy {summary['test_accuracy']:.4f}", flush=True)
    result = {
        "commit": commit,
        "dirty": dirty,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "workload": "+experiment=text_gpt, 2 gloo ranks on the CPU, 4 epochs, seed 0",
        "runs": results,
    }
    out = REPO / "bench" / "results" / f"text_gpt_recipe_{result['commit']}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"→ {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
