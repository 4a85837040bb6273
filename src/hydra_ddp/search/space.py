"""The search space: hydra.sweeper.params and the command line's sweeps, in Hydra's sweep syntax
(interval, choice, range, tag(log, ...)), as Optuna distributions; plain values stay fixed."""

from __future__ import annotations

from typing import Any

from hydra_ddp.errors import UserError


def parse(params: dict[str, Any], arguments: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """({key: distribution}, {key: fixed value as written}): params first, the command line over
    them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    written = [f"{key}={value}" for key, value in (params or {}).items()] + list(arguments)
    try:
        overrides = OverridesParser.create().parse_overrides(written)
    except OverrideParseException as error:
        raise UserError(
            f"the search space does not parse: {str(error).strip().splitlines()[0]}"
        ) from None
    searched: dict[str, Any] = {}
    fixed: dict[str, str] = {}
    for override in overrides:
        key = override.get_key_element()
        searched.pop(key, None)
        fixed.pop(key, None)
        if override.is_sweep_override():
            searched[key] = distribution(key, override)
        else:
            fixed[key] = override.get_value_element_as_str()
    if not searched:
        raise UserError(
            "the search space is empty: give hydra.sweeper.params (or a sweep on "
            "the command line), e.g. optim.lr='tag(log, interval(1e-4, 1e-1))'"
        )
    return searched, fixed


def distribution(key: str, override: Any) -> Any:
    """One sweep as an Optuna distribution: interval → float (log with tag(log, ...)); range → int
    or float steps, the stop excluded as in Python's range; choice → categorical."""
    from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    value = override.value()
    log = "log" in getattr(value, "tags", set())
    if isinstance(value, ChoiceSweep):
        if not value.list:
            raise UserError(f"{key}: choice() has no values")
        return CategoricalDistribution([_plain(v) for v in value.list])
    if isinstance(value, IntervalSweep):
        low, high = float(value.start), float(value.end)
        if not low < high or (log and low <= 0):
            raise UserError(
                f"{key}: interval({value.start}, {value.end}) needs start < end"
                + (" and start > 0 (log)" if log else "")
            )
        return FloatDistribution(low, high, log=log)
    if isinstance(value, RangeSweep):
        start, stop, step = value.start, value.stop, value.step
        count = int((stop - start) / step) + (1 if (stop - start) % step else 0) if step else 0
        if count < 1:
            raise UserError(f"{key}: range({start}, {stop}, {step}) holds no value")
        last = start + (count - 1) * step
        if all(isinstance(v, int) for v in (start, stop, step)):
            return IntDistribution(start, last, step=step, log=False)
        return FloatDistribution(float(start), float(last), step=float(step))
    raise UserError(
        f"{key}: {override.get_value_element_as_str()} is not a sweep this search takes "
        "(interval, choice, range, tag(log, ...))"
    )


def _plain(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    raise UserError(f"choice() takes plain values (str, int, float, bool, null), not {value!r}")


def grid(searched: dict[str, Any]) -> dict[str, list[Any]]:
    """The grid sampler's values per key: every choice or step (an interval has none to list)."""
    from optuna.distributions import CategoricalDistribution

    values: dict[str, list[Any]] = {}
    for key, dist in searched.items():
        if isinstance(dist, CategoricalDistribution):
            values[key] = list(dist.choices)
        elif getattr(dist, "step", None):
            count = round((dist.high - dist.low) / dist.step) + 1
            values[key] = [dist.low + i * dist.step for i in range(count)]
        else:
            raise UserError(f"{key}: the grid sampler needs choice() or range(), not an interval")
    return values


def as_override(key: str, value: Any) -> str:
    """A sampled value as a Hydra override."""
    if isinstance(value, str):
        return f"{key}={value}"
    if value is None:
        return f"{key}=null"
    if isinstance(value, bool):
        return f"{key}={str(value).lower()}"
    return f"{key}={value!r}"
