"""Whether runs train to the same bits as at another commit: each named run at that commit (a
worktree of it, its own `src` first on the path) and at this checkout, on this host, then every
value column of metrics.csv (the times and rates aside) and the final weights compared bit for bit.

    python bench/bit_identity.py --against 47b6e4e   # → bench/results/bit_identity_<commit>.json

The runs: the default run (`make train`'s) and `+experiment=text_gpt` cut to 30 steps, as they are
configured, with no overrides but the run directory and the step count.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import provenance
import torch
from run import checkout

REPO = Path(__file__).resolve().parents[1]
RUNS = {"default": (), "text_gpt": ("+experiment=text_gpt", "trainer.max_steps=30")}
TIMED = ("time", "per_sec")  # a column of rates or times differs run to run, by design


def train(repo: Path, run_dir: Path, overrides: tuple[str, ...]) -> None:
    path = os.pathsep.join(p for p in (str(repo / "src"), os.environ.get("PYTHONPATH")) if p)
    subprocess.run(
        [sys.executable, str(repo / "train.py"), *overrides, f"hydra.run.dir={run_dir}"],
        cwd=repo, env={**os.environ, "PYTHONPATH": path},
        check=True, capture_output=True, text=True,
    )  # fmt: skip


def compare(then: Path, now: Path) -> dict:
    """Rows, value columns and the cells that differ in metrics.csv; whether the final weights are
    equal."""

    def rows(run: Path) -> list[dict[str, str]]:
        with open(run / "metrics.csv", newline="") as f:
            return list(csv.DictReader(f))

    a, b = rows(then), rows(now)
    columns = [c for c in a[0] if not any(word in c for word in TIMED)]
    differ = [(i, c) for i, (x, y) in enumerate(zip(a, b)) for c in columns if x.get(c) != y.get(c)]
    weights = [
        torch.load(run / "checkpoints" / "last.pt", weights_only=True)["model"]
        for run in (then, now)
    ]
    same_weights = weights[0].keys() == weights[1].keys() and all(
        torch.equal(weights[0][k], weights[1][k]) for k in weights[0]
    )
    return {
        "rows": [len(a), len(b)],
        "value_columns": columns,
        "differing_cells": len(differ) + abs(len(a) - len(b)),
        "first_differences": differ[:5],
        "final_weights_identical": same_weights,
        "identical": not differ and len(a) == len(b) and same_weights,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, help="the commit to compare with")
    args = parser.parse_args()
    result: dict = provenance.header()
    with contextlib.ExitStack() as stack:
        against = checkout(args.against, stack)
        result["against"] = against["commit"]
        runs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="hydra-ddp-identity-")))
        for name, overrides in RUNS.items():
            train(Path(against["path"]), runs / f"{name}-then", overrides)
            train(REPO, runs / f"{name}-now", overrides)
            result[name] = compare(runs / f"{name}-then", runs / f"{name}-now")
            verdict = "identical" if result[name]["identical"] else "DIFFERENT"
            print(
                f"{name}: {verdict}, final weights equal: "
                f"{result[name]['final_weights_identical']}",
                flush=True,
            )
    out = REPO / "bench" / "results" / f"bit_identity_{result['commit']}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"→ {out.relative_to(REPO)}")
    return 0 if all(result[name]["identical"] for name in RUNS) else 1


if __name__ == "__main__":
    sys.exit(main())
