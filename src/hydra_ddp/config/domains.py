"""What each config key takes, written once, beside its field in the schema
(`Annotated[int, AtLeast(1)]`).

OmegaConf checks a value's type as the config is composed; a domain says which values of that type
mean something. `check` refuses the others before launch, one line naming the key; the
configuration reference lists them (reference.py); a generated test probes every key with a zero,
a negative number and an unknown word (tests/unit/test_values.py). A key whose values are checked by
code of their own (a checkpoint path, a metric of the task) says where (`Checked`); one whose every
value of its type means something says why (`Free`). A key with no annotation is a test failure.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import typing
from collections.abc import Mapping
from typing import Any, Optional, Union

from hydra_ddp.config.section import Section
from hydra_ddp.errors import UserError


class Domain:
    """The values of a key's type that mean something. `problem`: why `value` is not one (None: it
    is)."""

    def problem(self, value: Any) -> Optional[str]:
        raise NotImplementedError

    def allowed(self) -> str:
        """The reference's "allowed" column (markdown)."""
        return ""


def _show(value: Any) -> str:
    return (
        "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    )


@dataclasses.dataclass(frozen=True)
class OneOf(Domain):
    """One of a few words (or true/false beside auto)."""

    options: tuple[Any, ...]

    def __init__(self, *options: Any):
        object.__setattr__(self, "options", options)

    def problem(self, value: Any) -> Optional[str]:
        # Exact matches: True must not pass as 1, nor "32" as 32 (YAML gives the type the user
        # wrote).
        if any(value == option and type(value) is type(option) for option in self.options):
            return None
        if isinstance(value, int) and not isinstance(value, bool) and str(value) in self.options:
            return None  # trainer.precision=32 on the command line is the int 32
        return f"choose one of {', '.join(_show(o) for o in self.options)}"

    def allowed(self) -> str:
        return ", ".join(f"`{_show(o)}`" for o in self.options)


@dataclasses.dataclass(frozen=True)
class Number(Domain):
    """A number within bounds: `low` (inclusive, or exclusive with `above`), `high` (inclusive, or
    exclusive with `below`); `whole`: an integer; `also`: words that mean something too (auto)."""

    low: Optional[float] = None
    high: Optional[float] = None
    above: bool = False
    below: bool = False
    whole: bool = False
    also: tuple[str, ...] = ()

    def problem(self, value: Any) -> Optional[str]:
        if isinstance(value, str) and value in self.also:
            return None
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        fits = number and (not self.whole or float(value).is_integer())
        if fits and self.low is not None:
            fits = value > self.low if self.above else value >= self.low
        if fits and self.high is not None:
            fits = value < self.high if self.below else value <= self.high
        return None if fits else f"give {self.describe()}"

    def describe(self) -> str:
        kind = "a whole number" if self.whole else "a number"
        bounds = []
        if self.low is not None:
            bounds.append(f"{'above' if self.above else 'at least'} {_number(self.low)}")
        if self.high is not None:
            bounds.append(f"{'below' if self.below else 'at most'} {_number(self.high)}")
        words = f" (or {' or '.join(self.also)})" if self.also else ""
        return f"{kind}{', ' if bounds else ''}{' and '.join(bounds)}{words}"

    def allowed(self) -> str:
        return self.describe()


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def AtLeast(low: float, *also: str, whole: bool = True) -> Number:  # noqa: N802  (reads as a type)
    return Number(low=low, whole=whole, also=also)


def Positive(*also: str) -> Number:  # noqa: N802
    return Number(low=0, above=True, also=also)


AUTO_BOOL = OneOf("auto", True, False)


@dataclasses.dataclass(frozen=True)
class Pattern(Domain):
    """A word of a shape (a regular expression), described as `shape`."""

    regex: str
    shape: str

    def problem(self, value: Any) -> Optional[str]:
        return (
            None
            if isinstance(value, str) and re.fullmatch(self.regex, value)
            else f"give {self.shape}"
        )

    def allowed(self) -> str:
        return self.shape


@dataclasses.dataclass(frozen=True)
class Checked(Domain):
    """Checked by code of its own (`where`), which refuses a bad value in one line naming the
    key."""

    where: str

    def problem(self, value: Any) -> Optional[str]:
        return None


@dataclasses.dataclass(frozen=True)
class Free(Domain):
    """Every value of the key's type means something (`why`)."""

    why: str

    def problem(self, value: Any) -> Optional[str]:
        return None


@dataclasses.dataclass(frozen=True)
class Chosen(Domain):
    """A section whose schema the option chosen for it names (`strategy=fsdp`: the fsdp strategy's
    settings): `options()` maps each option's name to its dataclass."""

    group: str
    settings: Any  # {option's name: its dataclass}

    def options(self) -> dict[str, type]:
        return dict(self.settings)

    def problem(self, value: Any) -> Optional[str]:
        return None


def domain_of(cls: type, name: str) -> Optional[Domain]:
    """The Domain annotated on field `name` of schema class `cls` (None: not annotated)."""
    hint = _hints(cls).get(name)
    for arg in typing.get_args(hint) if typing.get_origin(hint) is typing.Annotated else ():
        if isinstance(arg, Domain):
            return arg
    return None


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def fields(
    cls: type, prefix: str = "", chosen: Optional[dict[str, str]] = None
) -> list[tuple[str, type, str]]:
    """(dotted key, class, field name) of every leaf field of a schema class, nested sections
    walked; a Chosen section as the option `chosen` names for it ({"strategy": "fsdp"}), else left
    out."""
    out = []
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default  # type: ignore[misc]
        domain = domain_of(cls, f.name)
        if isinstance(domain, Chosen):
            option = (chosen or {}).get(domain.group)
            if option in domain.options():
                out += fields(domain.options()[option], f"{prefix}{f.name}.", chosen)
        elif dataclasses.is_dataclass(default):
            out += fields(type(default), f"{prefix}{f.name}.", chosen)
        else:
            out.append((f"{prefix}{f.name}", cls, f.name))
    return out


def check(config: Union[Section, Mapping[str, Any]], cls: type) -> None:
    """Every annotated key of `config` (a typed config of schema class `cls`, or one made plain: a
    dict, Hydra's DictConfig) in its domain, or one line naming the first that is not. null passes
    where the type allows it (Optional)."""

    def value(node: Any, part: str) -> Any:
        return node.get(part, _ABSENT) if isinstance(node, dict) else getattr(node, part, _ABSENT)

    chosen = {}
    for f in dataclasses.fields(cls):
        section = value(config, f.name)
        if isinstance(domain_of(cls, f.name), Chosen) and section is not _ABSENT:
            chosen[f.name] = value(section, "name")
    for key, owner, name in fields(cls, chosen=chosen):
        domain = domain_of(owner, name)
        node: Any = config
        for part in key.split("."):
            node = value(node, part)
            if node is _ABSENT:
                break
        if node is _ABSENT or domain is None or (node is None and _optional(owner, name)):
            continue
        problem = domain.problem(node)
        if problem:
            shown = f"{node!r}" if isinstance(node, str) else _show(node)
            raise UserError(f"{key}={shown}: {problem}")


_ABSENT = object()


def _optional(cls: type, name: str) -> bool:
    hint = _hints(cls)[name]
    if typing.get_origin(hint) is typing.Annotated:
        hint = typing.get_args(hint)[0]
    return hint is Any or type(None) in typing.get_args(hint)
