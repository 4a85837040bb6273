"""Find the fastest settings for your model and data by timing a few real training steps under each.

    python -m hydra_ddp.tools.tune            # the default run's model and data
    python -m hydra_ddp.tools.tune model=resnet18 data=cifar10 trainer.nproc=4
    python -m hydra_ddp.tools.tune 'tune.knobs=[trainer.threads,strategy.bucket_cap_mb]' \
        tune.steps=100
    # bf16 (fp16 on GPUs) and compressed gradients too:
    python -m hydra_ddp.tools.tune tune.precision=true

Each candidate is a real run of your configuration, `tune.steps` steps at your world size,
launched as train.py launches (workers forked from a forkserver that already imported torch), in
a directory of its own; its steady samples/s decides. One knob at a time (coordinate descent):
every value of a knob is timed with the winners so far, and a value replaces the configured one
only when it is faster by `tune.min_gain`, which a busy machine's noise must not reach. At the end
the configured and the tuned settings are timed in turns, side by side, and the speed-up printed
is that measurement. Settings that change numerics beyond float tolerance (precision, gradient
compression) are tried only with tune.precision=true.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra_ddp import project, tools
from hydra_ddp.launch import startup

if __name__ == "__main__":
    startup.preload(sys.argv)  # the workers' imports start now, beside composing the config

import hydra  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from hydra_ddp.config import run_config  # noqa: E402
from hydra_ddp.config.schema import PRECISIONS, Config  # noqa: E402
from hydra_ddp.config.strategy_settings import COMM_HOOKS  # noqa: E402
from hydra_ddp.errors import UserError  # noqa: E402
from hydra_ddp.launch import command, resolve, workers  # noqa: E402
from hydra_ddp.parallel import strategies  # noqa: E402

CONF_DIR = project.package_config_path()  # the package's config groups (a project's come first)
KNOBS = (
    "data.num_workers",
    "data.pin_memory",
    "trainer.threads",
    "trainer.channels_last",
    "strategy.bucket_cap_mb",
    "strategy.shared_memory",
    "trainer.precision",
    "strategy.comm_hook",
)
# change results beyond float tolerance: tune.precision
NUMERICS = ("trainer.precision", "strategy.comm_hook")


@dataclass
class SettingsTuneConf:
    knobs: Optional[list[str]] = None  # which of KNOBS to try; null: every one that applies
    # per candidate; the first tenth is warm-up, left out as in the summary's steady samples/s
    steps: int = 40
    min_gain: float = 0.05  # a value must beat the configured one by this much (5 %) to replace it
    repeats: int = 2  # configured vs tuned, timed in turns at the end
    precision: bool = False  # also try bf16 / fp16 and compressed gradients (results change)


@dataclass
class SettingsTuneConfig(Config):
    tune: SettingsTuneConf = field(default_factory=SettingsTuneConf)


def candidates(cfg: run_config.RunConfig, tune: Any) -> dict[str, list[Any]]:
    """The values worth timing for each knob, on this device, at this world size."""
    cuda = cfg.trainer.device == "cuda"
    chosen = strategies.get(cfg.strategy.name)
    # The strategy's own knobs exist in its settings only (DDP's bucket size, hooks, shared memory).
    own = set(chosen.tunable)
    ranks, world = cfg.trainer.nproc, cfg.trainer.nproc * cfg.launcher.nnodes
    cores = len(os.sched_getaffinity(0))
    per_rank = max(1, cores // ranks)
    values: dict[str, list[Any]] = {
        "data.num_workers": sorted({0, 1, 2, min(4, per_rank)}),
        "data.pin_memory": [False, True] if cuda else [],
        "trainer.threads": sorted({max(1, per_rank // 2), per_rank, min(cores, 2 * per_rank)}),
        "trainer.channels_last": [True, False] if chosen.allows_channels_last() else [],
        "strategy.bucket_cap_mb": [5, 25, 100]
        if "strategy.bucket_cap_mb" in own and world > 1
        else [],
        # auto where it can serve (one host, CPU): timed against gloo's all-reduce.
        "strategy.shared_memory": (
            ["auto", False]
            if "strategy.shared_memory" in own and not cuda and ranks == world > 1
            else []
        ),
        "trainer.precision": [p for p in PRECISIONS if cuda or p != "16"],  # fp16 needs a GPU
        "strategy.comm_hook": list(COMM_HOOKS) if "strategy.comm_hook" in own and world > 1 else [],
    }
    wanted = list(tune.knobs) if tune.knobs is not None else list(KNOBS)
    unknown = [k for k in wanted if k not in KNOBS]
    if unknown:
        raise UserError(
            f"tune.knobs: unknown {', '.join(unknown)}; the knobs are {', '.join(KNOBS)}"
        )
    if not tune.precision:
        wanted = [k for k in wanted if k not in NUMERICS]
    return {k: values[k] for k in wanted if len(values[k]) > 1}


class Timer:
    """Times one setting: a short real run in a directory of its own, launched from this process."""

    def __init__(self, cfg: DictConfig, steps: int, scratch: Path):
        self.cfg, self.steps, self.scratch, self.runs = cfg, steps, scratch, 0

    def resolved(self, overrides: dict[str, Any], run_dir: Path) -> run_config.RunConfig:
        """The resolved (not yet frozen) config of a short run with these overrides: steps only (no
        checkpoints, loggers, progress bar or evaluation per epoch), and quiet (job "tune")."""
        cfg = self.cfg.copy()
        short = {
            "trainer.max_steps": self.steps,
            "trainer.epochs": 10**6,
            "trainer.resume": None,
            "trainer.init_from": None,
            "trainer.max_time": None,
            "trainer.profile": False,
            "trainer.eval_every_epoch": False,
            "trainer.progress": False,
            "trainer.early_stopping.patience": None,
            "checkpoint.every_epoch": False,
            "checkpoint.every_n_steps": None,
            "logger": {},
        }
        for key, value in {**overrides, **short}.items():
            OmegaConf.update(cfg, key, value, merge=False)
        plain = resolve.plain_config(cfg)
        plain.pop("tune")  # the tuner's own settings, not the run's
        resolved = resolve.resolve(plain, run_dir, external=None)
        changes = {"job": "tune", "sweep": None, "overridden": dict(overrides)}
        if getattr(resolved.strategy, "comm_hook", None) == "powersgd":
            changes["strategy.powersgd.start_step"] = 0  # timed compressing, not warming up
        return run_config.amended(resolved, changes)

    def samples_per_sec(self, overrides: dict[str, Any]) -> float:
        """Steady samples/s of a run with these overrides. A run that fails keeps its directory."""
        self.runs += 1
        run_dir = self.scratch / f"run-{self.runs}"
        run_dir.mkdir()
        summary = workers.launch(self.resolved(overrides, run_dir), run_dir, time.time())
        if not summary:
            raise UserError(
                f"the run with {_overrides(overrides) or 'your settings'} "
                f"wrote no summary: see {run_dir}"
            )
        shutil.rmtree(run_dir)
        return summary["steady_samples_per_sec"]


def _say(line: str) -> None:
    # each value as it is timed, through a pipe too: a slow search shows how far it got
    print(line, flush=True)


def tune(cfg: DictConfig, say: Any = _say) -> dict[str, Any]:
    """Coordinate descent over the knobs; returns the winners and the side-by-side speed-up."""
    settings = cfg.tune
    scratch = Path(tempfile.mkdtemp(prefix="hydra-ddp-tune-"))
    timer = Timer(cfg, settings.steps, scratch)
    configured = timer.resolved({}, scratch)
    knobs = candidates(configured, settings)
    ranks = configured.trainer.nproc * configured.launcher.nnodes
    say(
        f"timing {settings.steps} steps at {ranks} rank(s) "
        f"for each value of {', '.join(knobs) or 'no knob'}"
    )
    chosen: dict[str, Any] = {}
    for knob, values in knobs.items():
        current = run_config.lookup(configured, knob)  # threads resolved; auto stays auto
        speeds = []
        for value in ([] if current in values else [current]) + values:
            try:
                speeds.append((value, timer.samples_per_sec({**chosen, knob: value})))
            except command.Stopped:
                raise
            except UserError as error:
                if value == current:
                    raise
                # e.g. a precision this device lacks
                say(f"  {knob}={_text(value)}: failed: {error}")
                continue
            say(f"  {knob}={_text(value)}: {speeds[-1][1]:.0f} samples/s")
        configured_speed = next(speed for value, speed in speeds if value == current)
        best, best_speed = max(speeds, key=lambda pair: pair[1])
        if best != current and best_speed >= configured_speed * (1 + settings.min_gain):
            chosen[knob] = best
    result: dict[str, Any] = {"overrides": chosen}
    if chosen:
        pairs = [
            (timer.samples_per_sec({}), timer.samples_per_sec(chosen))
            for _ in range(settings.repeats)
        ]
        result = settle(chosen, pairs, settings.min_gain)
    result["runs"] = timer.runs
    if not any(scratch.iterdir()):  # the failed runs' directories stay, for their logs
        scratch.rmdir()
    return result


def settle(
    chosen: dict[str, Any], pairs: list[tuple[float, float]], min_gain: float
) -> dict[str, Any]:
    """The verdict of the side-by-side timing ((configured, tuned) samples/s, in turns): the
    search's winners stand only if they are still faster by min_gain there. The search times each
    value once, and one timing can catch a warm-up or a busy moment; the turns are the
    measurement."""
    configured, tuned = (
        statistics.median(p[0] for p in pairs),
        statistics.median(p[1] for p in pairs),
    )
    result: dict[str, Any] = {
        "configured": configured,
        "tuned": tuned,
        "speedup": tuned / configured,
    }
    confirmed = result["speedup"] >= 1 + min_gain
    result["overrides"] = chosen if confirmed else {}
    if not confirmed:
        result["unconfirmed"] = chosen
    return result


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _overrides(overrides: dict[str, Any]) -> str:
    return " ".join(f"{k}={_text(v)}" for k, v in overrides.items())


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        result = tune(cfg)
    except command.Stopped as stop:
        command.say("hydra-ddp: tune: stopped by a signal; nothing chosen")
        sys.exit(stop.exit_code)
    except UserError as error:
        command.fail(error)  # one line, exit 2 (a usage error, as train.py's)
        return
    if result.get("unconfirmed"):
        print(
            f"fastest: your settings ({_overrides(result['unconfirmed'])} won "
            f"the search but ran at {result['speedup']:.2f}× yours timed in "
            f"turns, not {1 + cfg.tune.min_gain:.2f}×; {result['runs']} runs)"
        )
        return
    if not result["overrides"]:
        print(
            "fastest: your settings (no value was "
            f"{cfg.tune.min_gain:.0%} faster; {result['runs']} runs)"
        )
        return
    print(
        f"fastest: {_overrides(result['overrides'])}  "
        f"({result['speedup']:.2f}× samples/s: {result['configured']:.0f} "
        f"→ {result['tuned']:.0f}, timed in turns; {result['runs']} runs)"
    )


if __name__ == "__main__":
    tools.measuring(SettingsTuneConfig)  # the training schema plus `tune`
    command.exit_after(main)
