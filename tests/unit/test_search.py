"""Searches on Optuna (hydra/sweeper=optuna, the project's own sweeper over Optuna's ask/tell API),
in this process: the search space in Hydra's sweep syntax, the samplers and their seeds, each
trial's own random stream (the searches themselves: tests/e2e/test_search.py)."""

from __future__ import annotations

import pytest

from hydra_ddp.config.schema import register_schema
from hydra_ddp.errors import UserError
from hydra_ddp.search import space

register_schema()


def test_the_search_space_takes_hydras_sweep_syntax():
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    searched, fixed = space.parse(
        {"optim.lr": "tag(log, interval(0.002, 0.1))", "data.batch_size": "choice(16, 32, 64)"},
        ["model.hidden=range(16, 65, 16)", "optim.momentum=0.8", "trainer.seed=interval(0, 1)"],
    )
    assert searched == {
        "optim.lr": FloatDistribution(0.002, 0.1, log=True),
        "data.batch_size": CategoricalDistribution([16, 32, 64]),
        "model.hidden": IntDistribution(16, 64, step=16),
        "trainer.seed": FloatDistribution(0.0, 1.0),
    }
    assert fixed == {"optim.momentum": "0.8"}
    # The command line over the params: a value there fixes a key the params search.
    assert space.parse(
        {"optim.lr": "choice(0.1, 0.2)", "data.batch_size": "choice(16, 32)"}, ["optim.lr=0.3"]
    ) == (
        {"data.batch_size": CategoricalDistribution([16, 32])},
        {"optim.lr": "0.3"},
    )
    assert (
        space.as_override("optim.lr", 1e-6) == "optim.lr=1e-06"
        and space.as_override("x", True) == "x=true"
    )


@pytest.mark.parametrize(
    "params, arguments, message",
    [
        ({}, [], "the search space is empty"),
        ({"optim.lr": "0.1"}, [], "the search space is empty"),
        ({"optim.lr": "interval(0.1)"}, [], "the search space does not parse"),
        (
            {"optim.lr": "tag(log, interval(0, 1))"},
            [],
            "optim.lr: interval(0.0, 1.0) needs start < end and start > 0 (log)",
        ),
        (
            {"data.batch_size": "range(64, 16)"},
            [],
            "data.batch_size: range(64, 16, 1) holds no value",
        ),
    ],
)
def test_a_bad_search_space_is_one_line(params, arguments, message):
    with pytest.raises(UserError) as refused:
        space.parse(params, arguments)
    assert message in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "sampler, kind",
    [
        ("tpe", "TPESampler"),
        ("random", "RandomSampler"),
        ("cmaes", "CmaEsSampler"),
        ("grid", "GridSampler"),
    ],
)
def test_each_sampler_builds_with_its_seed(sampler: str, kind: str):
    import functools

    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from support import REPO

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose(
            config_name="config",
            overrides=[
                "hydra/sweeper=optuna",
                f"hydra/sweeper/sampler={sampler}",
                "hydra.sweeper.sampler.seed=3",
            ],
            return_hydra_config=True,
        )
    built = instantiate(cfg.hydra.sweeper.sampler)
    if isinstance(built, functools.partial):  # the grid: given the space's values by the sweeper
        searched, _ = space.parse(
            {"data.batch_size": "choice(16, 32)", "model.hidden": "range(8, 17, 8)"}, []
        )
        built = built(search_space=space.grid(searched))
        # shuffled by the seed
        assert sorted(built._all_grids) == [(16, 8), (16, 16), (32, 8), (32, 16)]
    assert type(built).__name__ == kind and cfg.hydra.sweeper.sampler.seed == 3


@pytest.mark.parametrize("sampler", ["tpe", "random", "cmaes", "grid"])
def test_each_trial_draws_from_a_stream_of_its_own_and_a_seeded_search_draws_the_same_again(
    sampler: str,
):
    """Sweeper processes on one study (n_jobs > 1) used to build the same seeded sampler, so their
    startup trials drew the same values. Each trial's sampler now has its trial's own seed: two
    processes' first asks differ, and the same trial number draws the same values in a rerun."""
    import optuna
    from hydra import compose, initialize_config_dir

    from hydra_plugins.hydra_ddp_optuna.sweeper import OptunaSweeper

    from support import REPO

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose(
            config_name="config",
            overrides=[
                "hydra/sweeper=optuna",
                f"hydra/sweeper/sampler={sampler}",
                "hydra.sweeper.sampler.seed=0",
            ],
            return_hydra_config=True,
        )
    sweeper = OptunaSweeper(
        sampler=cfg.hydra.sweeper.sampler,
        direction="maximize",
        study_name="s",
        storage=None,
        n_trials=8,
        n_jobs=2,
        pruner="none",
        params=None,
    )
    grid = {"optim.lr": "choice(0.1, 0.2, 0.3, 0.4)", "data.batch_size": "choice(16, 32)"}
    searched, _ = space.parse(
        grid
        if sampler == "grid"
        else {
            "optim.lr": "tag(log, interval(0.002, 0.1))",
            "optim.weight_decay": "interval(0, 0.01)",
        },
        [],
    )

    def draws(streams) -> list[dict]:
        study = optuna.create_study(direction="maximize")
        asked = []
        for stream in streams:  # as two processes on one study ask, one after the other
            study.sampler = sweeper._sampler(searched, stream=stream)
            asked.append(study.ask(searched).params)
        return asked

    first = draws([0, 1, 2, 3])
    assert len({tuple(sorted(p.items())) for p in first}) == 4, first  # no two trials alike
    assert draws([0, 1, 2, 3]) == first  # seeded: the same again
    # the grid's points are one shuffle for every process; it skips those already taken
    if sampler != "grid":
        assert draws([0])[0] != draws([1])[0]
