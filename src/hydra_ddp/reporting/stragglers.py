"""Where each rank's step time goes, and which rank the others wait for, from every rank's time by
phase (training/meter.py times them).

Every rank adds up the time of its steps by phase: waiting for the next batch (data), forward,
backward, the optimizer, and the loop's own work between steps (other). The backward of a step's
last batch ends at DDP's gradient all-reduce, which no rank leaves before the slowest arrives: the
backward time a rank spends beyond the fastest rank's is time spent waiting there (sync wait). The
rank that waits least is the one the others wait for, and the phase where it spends more than the
others is the cause.
"""

from __future__ import annotations

import statistics
from typing import Any, Optional

# other: the loop's own work between steps
PHASES = ("data", "forward", "backward", "optimizer", "other")
# Others waiting at least this share of their step time for one rank: a straggler worth naming.
NOTABLE_WAIT = 0.2
ADVICE = {
    "data": "raise data.num_workers (or data.preload=true for "
    "in-memory data), or check this rank's data source",
    "forward": "check this rank's device and its CPU threads "
    "(trainer.threads), or other load on its cores",
    "optimizer": "check this rank's device and its CPU threads "
    "(trainer.threads), or other load on its cores",
    "other": "its work between steps (rank 0: logging and checkpoints): "
    "raise trainer.log_every or checkpoint less often",
}


def per_rank(gathered: list[dict[str, float]]) -> list[dict[str, Any]]:
    """Per rank: seconds per step by phase, with backward split into compute (the fastest rank's)
    and sync wait (the rest), and each phase's share of the step."""
    if not gathered:
        return []
    per_step = [{p: g[p] / max(g["steps"], 1) for p in PHASES} for g in gathered]
    backward = min(s["backward"] for s in per_step)
    rows = []
    for rank, s in enumerate(per_step):
        step = sum(s.values())
        phases = {
            "data": s["data"],
            "forward": s["forward"],
            "backward": backward,
            "sync_wait": s["backward"] - backward,
            "optimizer": s["optimizer"],
            "other": s["other"],
        }
        rows.append(
            {
                "rank": rank,
                "step_time_s": step,
                **{f"{k}_s": v for k, v in phases.items()},
                **{f"{k}_share": v / step if step else 0.0 for k, v in phases.items()},
            }
        )
    return rows


def straggler(rows: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The rank the others wait for, when they wait notably, with its dominant extra cost."""
    if len(rows) < 2:
        return None
    slow = min(rows, key=lambda r: r["sync_wait_s"])  # it arrives last: it hardly waits
    others = [r for r in rows if r is not slow]
    waiting = statistics.median(r["sync_wait_share"] for r in others)
    if waiting < NOTABLE_WAIT:
        return None
    excess = {p: slow[f"{p}_s"] - statistics.median(r[f"{p}_s"] for r in others) for p in ADVICE}
    cause = max(excess, key=excess.get)  # type: ignore[arg-type]
    if excess[cause] < 0.5 * statistics.median(r["sync_wait_s"] for r in others):
        # no phase of its own explains the waiting: contention that moves about, not a straggler
        return None
    label = "data wait" if cause == "data" else cause
    others_share = statistics.median(r[f"{cause}_share"] for r in others)
    return {
        "rank": slow["rank"],
        "cause": cause,
        "others_wait_share": waiting,
        "message": (
            f"rank {slow['rank']}: {label} {slow[f'{cause}_share']:.0%} of step time (others "
            f"{others_share:.0%}; they wait {waiting:.0%} of theirs for it) → {ADVICE[cause]}"
        ),
    }
