"""The sweeper and its configs (hydra/sweeper: optuna; hydra/sweeper/sampler: tpe, random, cmaes,
grid).

No `from __future__ import annotations`: Hydra loads plugin modules outside sys.modules, where
dataclasses cannot resolve string annotations."""

import logging
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Optional

from hydra.core.config_store import ConfigStore
from hydra.plugins.sweeper import Sweeper
from omegaconf import MISSING, DictConfig, OmegaConf

from hydra_ddp.config.domains import AtLeast, Checked, Free, Number, OneOf
from hydra_ddp.config.schema import PRUNERS

# The hook each trial's workers ask the pruner through (named: plugin discovery imports this module,
# which must not import torch).
PRUNING_HOOK = "hydra_ddp.search.pruning.Pruning"
log = logging.getLogger(__name__)


# A sampler's seed: numpy's SeedSequence takes 0 to 2**32 - 1 (search.study.trial_seed).
SEED = Number(low=0, high=2**32 - 1, whole=True)


@dataclass
class TPESamplerConf:
    _target_: str = "optuna.samplers.TPESampler"
    seed: Annotated[Optional[int], SEED] = None
    n_startup_trials: Annotated[int, AtLeast(0)] = 10
    multivariate: bool = False


@dataclass
class RandomSamplerConf:
    _target_: str = "optuna.samplers.RandomSampler"
    seed: Annotated[Optional[int], SEED] = None


@dataclass
class CmaEsSamplerConf:
    _target_: str = "optuna.samplers.CmaEsSampler"
    seed: Annotated[Optional[int], SEED] = None
    n_startup_trials: Annotated[int, AtLeast(0)] = 1


@dataclass
class GridSamplerConf:
    # The grid is the search space's choice() and range() values (hydra_ddp.search.space.grid).
    _target_: str = "optuna.samplers.GridSampler"
    _partial_: bool = True
    seed: Annotated[Optional[int], SEED] = None


@dataclass
class OptunaSweeperConf:
    _target_: str = "hydra_plugins.hydra_ddp_optuna.sweeper.OptunaSweeper"
    defaults: list[Any] = field(default_factory=lambda: [{"sampler": "tpe"}])
    sampler: Any = MISSING
    # trainer.monitor's: maximize for an accuracy (checked before the first trial)
    direction: Annotated[str, OneOf("minimize", "maximize")] = "minimize"
    study_name: Annotated[Optional[str], Free("any name")] = None  # null: "search"
    # null: a journal file in the sweep directory (hydra_ddp.search.study); or an Optuna storage
    # URL.
    storage: Annotated[Optional[str], Free("a file or Optuna's storage URL")] = None
    # In the study, over every run of the command with this sweep directory.
    n_trials: Annotated[int, AtLeast(1)] = 20
    n_jobs: Annotated[int, AtLeast(1)] = 1  # trials in flight: a new one starts as soon as one ends
    # median, hyperband or none: stops a hopeless trial after a validation
    pruner: Annotated[str, OneOf(*PRUNERS)] = "median"
    # e.g. {n_startup_trials: 5} (Optuna's own)
    pruner_args: Annotated[dict[str, Any], Checked("search.study.pruner_of")] = field(
        default_factory=dict
    )
    params: Annotated[Optional[dict[str, str]], Checked("search.space.parse")] = None
    # helper: one of the n_jobs - 1 processes the main sweeper starts
    role: Annotated[str, OneOf("main", "helper")] = "main"
    # The sampler stays a config (Hydra would build it once, with the sweeper): each trial's is
    # built from it with a seed of its own (search.study.trial_seed), so processes sharing a study
    # draw apart, and a seeded search draws the same values for the same trial numbers.
    _recursive_: bool = False


ConfigStore.instance().store(
    group="hydra/sweeper", name="optuna", node=OptunaSweeperConf, provider="hydra_ddp"
)
SAMPLERS = {
    "tpe": TPESamplerConf,
    "random": RandomSamplerConf,
    "cmaes": CmaEsSamplerConf,
    "grid": GridSamplerConf,
}
for _name, _node in SAMPLERS.items():
    ConfigStore.instance().store(
        group="hydra/sweeper/sampler", name=_name, node=_node, provider="hydra_ddp"
    )


class OptunaSweeper(Sweeper):
    def __init__(self, **keys: Any):
        """`keys`: hydra.sweeper's, as Hydra checked them against OptunaSweeperConf (the settings
        object this reads them into)."""
        settings = OptunaSweeperConf(**keys)
        self.sampler_cfg, self.direction = settings.sampler, str(settings.direction)
        self.study_name, self.storage = settings.study_name or "search", settings.storage
        self.n_trials, self.n_jobs, self.pruner = (
            settings.n_trials,
            settings.n_jobs,
            settings.pruner,
        )
        self.params = OmegaConf.to_container(settings.params) if settings.params else {}
        self.role = settings.role
        self.pruner_args = dict(settings.pruner_args or {})

    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        from hydra.core.plugins import Plugins

        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            config=config, hydra_context=hydra_context, task_function=task_function
        )
        self.sweep_dir = Path(config.hydra.sweep.dir).resolve()

    def sweep(self, arguments: list[str]) -> None:
        from hydra_ddp.errors import UserError

        try:
            self._search(arguments)
        except UserError as error:
            print(f"hydra-ddp: error: {error}", file=sys.stderr)
            sys.exit(2)

    def _search(self, arguments: list[str]) -> None:
        import optuna

        from hydra_ddp.search import space
        from hydra_ddp.search import study as studies

        searched, fixed = space.parse(self.params, arguments)
        self.check()
        # the grid's values checked before the first trial
        sampler = self._sampler(searched, stream=0)
        self.sweep_dir.mkdir(parents=True, exist_ok=True)
        location = self.storage or str(self.sweep_dir / studies.JOURNAL)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(
            study_name=self.study_name,
            storage=studies.storage_of(location),
            sampler=sampler,
            direction=self.direction,
            load_if_exists=True,
        )
        helpers = []
        if self.role == "main":
            stranded = studies.recover(study, self.sweep_dir)
            done = studies.started(study)
            log.info(
                "study %r in %s: %d of %d trials done%s",
                self.study_name,
                location,
                done,
                self.n_trials,
                f" ({len(stranded)} left running by a stopped sweep: failed)" if stranded else "",
            )
            helpers = [self._helper() for _ in range(self.n_jobs - 1)]
        identity = [
            f"trial.study={self.study_name}",
            f"trial.storage={location}",
            f"trial.pruner={self.pruner}",
            f"trial.hook={PRUNING_HOOK}",
            *(f"+trial.pruner_args.{k}={v}" for k, v in self.pruner_args.items()),
        ]
        try:
            while True:
                with studies.exclusive(self.sweep_dir):
                    if studies.started(study) >= self.n_trials:
                        break
                    # A trial number not yet asked for (a queued trial's ask adds none, and samples
                    # nothing).
                    study.sampler = self._sampler(
                        searched, stream=len(study.get_trials(deepcopy=False))
                    )
                    trial = study.ask(searched)
                overrides = [
                    *(f"{k}={v}" for k, v in fixed.items()),
                    *(space.as_override(k, v) for k, v in trial.params.items()),
                    *identity,
                    f"trial.number={trial.number}",
                ]
                returned = self.launcher.launch([overrides], initial_job_idx=trial.number)[0]
                self._tell(study, trial.number, returned)
        finally:
            for helper in helpers:
                helper.wait()
        if self.role == "main":
            self._results(study)

    def check(self) -> None:
        """The sweeper's own settings, each in its domain (config.domains), one line naming the
        first that is not: before the first trial."""
        from hydra_ddp.config import domains
        from hydra_ddp.errors import UserError
        from hydra_ddp.search import study as studies

        if not isinstance(self.sampler_cfg, DictConfig) or "_target_" not in self.sampler_cfg:
            shown = (
                OmegaConf.to_container(self.sampler_cfg)
                if isinstance(self.sampler_cfg, DictConfig)
                else None
            )
            raise UserError(
                f"hydra.sweeper.sampler={shown if shown is not None else self.sampler_cfg!r}: "
                "a sampler is chosen by its group, hydra/sweeper/sampler=NAME "
                f"({', '.join(SAMPLERS)}), and set by its keys, hydra.sweeper.sampler.KEY=VALUE"
            )
        settings = {
            "direction": self.direction,
            "study_name": self.study_name,
            "storage": self.storage,
            "n_trials": self.n_trials,
            "n_jobs": self.n_jobs,
            "pruner": self.pruner,
            "role": self.role,
        }
        sampler = OmegaConf.to_container(self.sampler_cfg)
        kind = next(
            (conf for conf in SAMPLERS.values() if conf._target_ == sampler.get("_target_")), None
        )
        for node, cls, where in (
            (settings, OptunaSweeperConf, "hydra.sweeper"),
            (sampler, kind, "hydra.sweeper.sampler"),
        ):
            try:
                if cls is not None:
                    domains.check(node, cls)
            except UserError as error:
                raise UserError(f"{where}.{error}") from None
        # its arguments, checked before the first trial
        studies.pruner_of(self.pruner, self.pruner_args)

    def _sampler(self, searched: dict[str, Any], stream: int) -> Any:
        """The sampler for the trial asked for when the study holds `stream` trials: its seed (when
        one is set) made that trial's own. Every sweeper process built the same seeded sampler
        before, so n_jobs > 1 drew the same startup trials in each process."""
        from hydra.utils import instantiate

        from hydra_ddp.search import space
        from hydra_ddp.search import study as studies

        seed = self.sampler_cfg.get("seed")
        if self.sampler_cfg.get("_partial_"):  # the grid sampler, given its grid
            # Its seed shuffles the grid, whose ids must mean the same in every process: one seed.
            # It never picks a grid point another trial holds (asks are one at a time:
            # studies.exclusive).
            return instantiate(self.sampler_cfg)(search_space=space.grid(searched))
        return instantiate(
            self.sampler_cfg, seed=None if seed is None else studies.trial_seed(seed, stream)
        )

    def _tell(self, study: Any, number: int, returned: Any) -> None:
        from hydra.core.utils import JobStatus
        from optuna.trial import TrialState

        from hydra_ddp.search import study as studies

        job_dir = (
            Path(returned.hydra_cfg.hydra.runtime.output_dir)
            if returned.hydra_cfg
            else self.sweep_dir / str(number)
        )
        value = returned._return_value if returned.status == JobStatus.COMPLETED else None
        state, value = studies.outcome(job_dir, value)
        if state == "complete":
            study.tell(number, value)
        else:
            study.tell(number, state=TrialState.PRUNED if state == "pruned" else TrialState.FAIL)
        log.info("trial %d: %s%s", number, state, f" ({value:.6g})" if value is not None else "")

    def _helper(self) -> subprocess.Popen:
        """Another sweeper process on the same study: the same command, as a helper, in this sweep
        directory."""
        argv = [
            a for a in sys.argv[1:] if not a.startswith(("hydra.sweep.dir=", "hydra.sweeper.role="))
        ]
        return subprocess.Popen(
            [
                sys.executable,
                sys.argv[0],
                *argv,
                f"hydra.sweep.dir={self.sweep_dir}",
                "hydra.sweeper.role=helper",
            ]
        )

    def _results(self, study: Any) -> None:
        from optuna.trial import TrialState

        finished = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if not finished:
            log.warning("no trial completed")
            return
        best = study.best_trial
        OmegaConf.save(
            OmegaConf.create(
                {
                    "name": "optuna",
                    "best_params": best.params,
                    "best_value": best.value,
                    "best_trial": best.number,
                }
            ),
            self.sweep_dir / "optimization_results.yaml",
        )
        log.info(
            "best trial %d: %s = %.6g (%s)",
            best.number,
            self.direction,
            best.value,
            " ".join(f"{k}={v}" for k, v in best.params.items()),
        )
