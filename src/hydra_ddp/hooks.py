"""The loop's hooks: side jobs on a fixed set of events. Every rank calls every event at the same
point of the loop, so a collective inside one lines up across the ranks.

    running(loop)                    a context around the whole fit, entered before its first step
    step_ended(loop, step)           after each optimizer step: the weights and the rate updated
    validated(loop, metrics, epoch)  after an epoch's validation (metrics: global: val_loss,
                                     val_<metric>, train_loss); a reason to end the run (a word:
                                     "pruned"), or None

`loop` is the Trainer: what a hook may read (loop.cfg, loop.pos.step, loop.device, loop.reporter,
loop.monitor) it reads there. trainer.hooks names a user's own, each a `_target_` config built with
its own keys (docs/extending.md); the profiler (trainer.profile: training/profiling.py) and a
search trial's pruner (search/pruning.py) are hooks too. This module stands below the loop, so
that what hooks into it (a user's package, the search) needs nothing of the loop but this. What is
part of a step's arithmetic (the EMA's update, the learning rate's step) or times it
(training/timing.py) stays in the step.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

EVENTS = ("running", "step_ended", "validated")


class Hook:
    """A side job of the loop: each event does nothing here; a hook overrides the ones it needs."""

    def running(self, loop: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def step_ended(self, loop: Any, step: int) -> None:
        return None

    def validated(self, loop: Any, metrics: dict[str, Any], epoch: int) -> Optional[str]:
        return None


def build(configs: list[Any], *builtin: Optional[Hook]) -> list[Hook]:
    """The run's hooks: the built-in ones that are on (None: off), then trainer.hooks' in order."""
    from hydra.utils import instantiate

    return [hook for hook in builtin if hook is not None] + [
        instantiate(config) for config in configs
    ]
