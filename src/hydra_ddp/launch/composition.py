"""Hydra's own errors as the project's one line: a misspelt key, a value of the wrong type, an
unknown group option or an override that does not parse, refused while the config is composed,
before anything runs. Hydra prints these as several lines (the key, the schema's class, the search
path) and exits 1; train.py and eval.py say what is wrong and what to do in one, and exit 2."""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from collections.abc import Callable
from typing import Any, Optional

_TYPE = re.compile(
    r"Value '(.*)' (?:of type '(\w+)' could not be converted to (\w+)|is not a valid (\w+))"
)
_MISSING_OPTION = re.compile(r"Could not find '([^']+)/([^']+)'")
_NOT_IN = re.compile(r"Key '([^']+)' (?:is )?not in (?:struct|'(\w+)')")


def one_line(error: BaseException) -> Optional[str]:
    """The line for a composition error (None: not one; Hydra reports it as it does)."""
    from hydra.errors import (
        ConfigCompositionException,
        MissingConfigException,
        OverrideParseException,
    )
    from omegaconf.errors import OmegaConfBaseException

    if not isinstance(
        error,
        (
            ConfigCompositionException,
            MissingConfigException,
            OverrideParseException,
            OmegaConfBaseException,
        ),
    ):
        return None
    text = str(error)
    cause = error.__cause__ if error.__cause__ is not None else error
    key = getattr(cause, "full_key", None) or getattr(error, "full_key", None)
    found = _TYPE.search(f"{text}\n{cause}")
    if found and key:
        value, _, wanted, plain = found.groups()
        kind = {
            "Integer": "a whole number",
            "Float": "a number",
            "Boolean": "true or false",
            "bool": "true or false",
        }.get(wanted or plain, (wanted or plain or "another type").lower())
        return f"{key}={value!r}: give {kind} (docs/reference/config.md: every key's type)"
    missing = _MISSING_OPTION.search(text)
    if missing:
        group, option = missing.groups()
        available = re.findall(r"^\t(\S+)$", text.split("Config search path:")[0], re.MULTILINE)
        fix = (
            f"choose one of {', '.join(available)}"
            if available
            else f"add conf/{group}/{option}.yaml"
        )
        return f"{group}={option}: no such option in conf/{group}/; {fix}"
    absent = _NOT_IN.search(f"{text}\n{cause}")
    owner = _strategy_of(absent.group(2)) if absent and absent.group(2) else None
    if absent and key and owner:
        settings = ", ".join(f.name for f in dataclasses.fields(owner.Settings) if f.name != "name")
        return (
            f"{key}: strategy={owner.name} has no such setting (its settings: "
            f"{settings or 'none'}); another strategy's knob does not apply to this one"
        )
    if absent and key:
        nearest = _nearest(key, getattr(cause, "parent_node", None))
        if nearest:
            return f"{key}: no such key in the config; did you mean {nearest}?"
        return (
            f"{key}: no such key in the config (misspelt?); "
            f"docs/reference/config.md lists every key, and +{key}=... adds "
            "one to a group that takes its own (a model's, an optimizer's)"
        )
    if isinstance(error, OverrideParseException):
        return (
            f"an override does not parse: {text.splitlines()[0]} "
            "(Hydra's override syntax: key=value)"
        )
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return f"{first}{f' ({key})' if key and key not in first else ''}"


def _nearest(key: str, parent: Any) -> Optional[str]:
    """The key of the same section closest to a misspelt one (trainer.epoch: trainer.epochs), when
    one is close enough to be what was meant."""
    import difflib

    keys = [str(k) for k in parent.keys()] if hasattr(parent, "keys") else []
    *section, name = key.split(".")
    found = difflib.get_close_matches(name, keys, n=1, cutoff=0.75)
    return ".".join([*section, found[0]]) if found else None


def _strategy_of(settings_class: str) -> Any:
    """The strategy whose settings dataclass has this name, if any."""
    from hydra_ddp.parallel import strategies

    return next(
        (s for s in strategies.REGISTRY.values() if s.Settings.__name__ == settings_class), None
    )


def report_in_one_line() -> None:
    """Hydra's error report, for the composition errors above: one line on stderr, exit 2. Other
    errors, and HYDRA_FULL_ERROR=1 (the traceback), are left to Hydra."""
    from hydra._internal import utils

    hydras: Callable[[Any], Any] = utils.run_and_report
    if getattr(hydras, "one_line", False):
        return

    def run_and_report(func: Any) -> Any:
        try:
            return func()
        except Exception as error:  # noqa: BLE001  (sorted below: ours, or Hydra's to report)
            line = None if os.environ.get("HYDRA_FULL_ERROR") == "1" else one_line(error)
            if line is None:
                return hydras(_raise(error))
            sys.stderr.write(f"hydra-ddp: error: {line}\n")
            sys.exit(2)

    run_and_report.one_line = True  # type: ignore[attr-defined]
    utils.run_and_report = run_and_report


def _raise(error: BaseException) -> Callable[[], Any]:
    def again() -> Any:
        raise error

    return again
