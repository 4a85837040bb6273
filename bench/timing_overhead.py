"""What the per-rank timing (src/hydra_ddp/training/meter.py) costs per step, against the step
itself.

    .venv/bin/python bench/timing_overhead.py [STEP_TIME_S]

Times the timer's own work per step (the timed batch iterator, four laps, the step's end) over
many steps, against the same loop untimed, and reports it as a share of a step: of STEP_TIME_S,
or of the default run's median step measured here (a short run of train.py). The per-epoch
all-gather of the totals is one small collective per epoch, timed beside it. The side-by-side run
of train.py with trainer.timing=false is in bench/run.py's options section.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from hydra_ddp.training.meter import StepTimer  # noqa: E402

STEPS = 200_000


def per_step_cost(enabled: bool) -> float:
    timer = StepTimer(enabled)
    batches = [(None, None)] * STEPS
    started = time.perf_counter()
    for _ in timer.batches(batches):
        timer.lap("forward")
        timer.lap("backward")
        timer.lap("optimizer")
        timer.end_step()
    return (time.perf_counter() - started) / STEPS


def default_step_time() -> float:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                sys.executable,
                str(REPO / "train.py"),
                "trainer.epochs=3",
                f"hydra.run.dir={tmp}/run",
            ],
            cwd=REPO,
            check=True,
            capture_output=True,
        )
        return json.loads((Path(tmp) / "run" / "summary.json").read_text())["median_step_time_s"]


def main() -> None:
    on = statistics.median(per_step_cost(True) for _ in range(5))
    off = statistics.median(per_step_cost(False) for _ in range(5))
    step = float(sys.argv[1]) if len(sys.argv) > 1 else default_step_time()
    cost = on - off
    print(
        f"timer per step: {cost * 1e6:.2f} µs (timed loop "
        f"{on * 1e6:.2f} µs, untimed {off * 1e6:.2f} µs)"
    )
    print(f"step time: {step * 1e3:.1f} ms → overhead {cost / step:.4%} of a step (limit 2 %)")


if __name__ == "__main__":
    main()
