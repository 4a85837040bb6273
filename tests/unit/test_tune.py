"""The tuner's verdict: what the side-by-side timing decides (tools/tune.settle)."""

from hydra_ddp.tools.tune import settle

CHOSEN = {"trainer.precision": "bf16"}


def test_winners_stand_when_the_turns_confirm_the_gain():
    result = settle(CHOSEN, [(100.0, 130.0), (110.0, 120.0), (90.0, 125.0)], min_gain=0.05)
    assert result["overrides"] == CHOSEN and "unconfirmed" not in result
    assert (result["configured"], result["tuned"]) == (100.0, 125.0) and result["speedup"] == 1.25


def test_a_winner_of_one_timing_that_the_turns_find_slower_is_not_chosen():
    # As the H200's GPU check saw it: bf16 won its one timing, then ran 0.67× the configured speed
    # in turns.
    result = settle(CHOSEN, [(21807.0, 14634.0)], min_gain=0.05)
    assert result["overrides"] == {} and result["unconfirmed"] == CHOSEN
    assert round(result["speedup"], 2) == 0.67


def test_a_gain_under_the_margin_in_turns_is_not_chosen():
    result = settle(CHOSEN, [(100.0, 104.0)], min_gain=0.05)
    assert result["overrides"] == {} and result["unconfirmed"] == CHOSEN
