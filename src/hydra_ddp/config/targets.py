"""The objects a config builds by `_target_` (task, model, data, optimizer, schedule, loggers),
checked before anything is built: the name imports, and the class or function takes the configured
keys."""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

from hydra_ddp.errors import UserError


def check(node: Any, key: str) -> Any:
    """The `_target_` imports and takes the configured arguments (the object is not built); returns
    what it names."""
    if not isinstance(node, dict) or "_target_" not in node:
        raise UserError(f"{key} needs a _target_ (the class or function that builds it)")
    target = locate(node["_target_"], key)
    kwargs = {k: v for k, v in node.items() if not k.startswith("_")}
    try:
        # a class that reads its keys as a settings object (a logger's Settings) is checked by it
        signature = inspect.signature(getattr(target, "Settings", target))
    except (TypeError, ValueError):
        return target  # some builtins have no signature: they are checked when built
    try:
        signature.bind_partial(**kwargs)
    except TypeError as e:
        group = key.split(".")[0]
        unknown = re.search(r"unexpected keyword argument '(\w+)'", str(e))
        # a key another option set (an experiment's, for the option it chose): remove it with ~
        if unknown:
            name = unknown.group(1)
            raise UserError(
                f"{key} ({node['_target_']}) takes no {name!r}: remove it with "
                f"'~{key}.{name}' on the command line (a setting of another "
                f"{group} option, an experiment's say), or fix it in conf/{group}/"
            ) from None
        raise UserError(
            f"{key} ({node['_target_']}): {e}; fix the key in conf/{group}/ or on the command line"
        ) from None
    return target


def locate(path: str, key: str) -> Any:
    """The object named by a dotted path, or a UserError naming the part that fails."""
    if not isinstance(path, str):
        raise UserError(f"{key}._target_={path!r} is not a dotted path such as package.module.Name")
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:split])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name and module_name.startswith(e.name) and split > 1:
                continue  # maybe a class attribute path; try a shorter module
            raise UserError(
                f"{key}._target_={path!r}: cannot import {module_name!r} ({e})"
            ) from None
        try:
            for attr in parts[split:]:
                obj = getattr(obj, attr)
            return obj
        except AttributeError:
            raise UserError(
                f"{key}._target_={path!r}: {module_name!r} has no {'.'.join(parts[split:])!r}"
            ) from None
    raise UserError(f"{key}._target_={path!r} is not a dotted path such as package.module.Name")
