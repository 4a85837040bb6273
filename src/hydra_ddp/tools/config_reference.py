"""The configuration reference (docs/reference/config.md), generated from the schema: every key, its
type, default, allowed values and the schema's own comment on it.

    python -m hydra_ddp.tools.config_reference          # rewrite docs/reference/config.md
    python -m hydra_ddp.tools.config_reference --check  # exit 1 if out of date (the tests do)

A field's doc is the comment block right above it in schema.py, or the comment after it on its
line; a field with neither is an error here (tests/unit/test_docs.py), so the reference cannot lose
one. Defaults are the values of the default run's composed config (what `python train.py` gets)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import sys
import tokenize
import typing
from pathlib import Path
from typing import Any, Optional

from hydra_ddp import project
from hydra_ddp.config import domains, schema

REPO = Path(__file__).resolve().parents[3]
OUT = REPO / "docs" / "reference" / "config.md"  # in a clone; an installed package prints the page
CONF = Path(project.package_config_path())
# Groups chosen by name (conf/GROUP/NAME.yaml) whose YAML sets the section's `name`.
NAMED_GROUPS = ("backend", "init_method", "launcher", "strategy")
# Groups whose objects are built with `_target_`: open to the user's own classes.
TARGET_GROUPS = ("task", "model", "data", "optim", "scheduler", "logger")


def field_docs(source: str) -> dict[tuple[str, str], str]:
    """(class, field) → its comment, from schema.py's text."""
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
    lines = source.split("\n")
    docs = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            above, line = [], item.lineno - 1
            while line >= 1 and line in comments and lines[line - 1].strip().startswith("#"):
                if comments[line].startswith("---"):  # a section's heading, not this field's doc
                    break
                above.insert(0, comments[line])
                line -= 1
            trailing = (
                comments.get(item.lineno)
                if not lines[item.lineno - 1].strip().startswith("#")
                else None
            )
            text = " ".join(above + ([trailing] if trailing else []))
            if text:
                docs[(node.name, item.target.id)] = text
    return docs


def allowed(cls: type, name: str) -> str:
    """The "allowed" cell of a field: its domain's words (domains.py), null where the type takes
    it."""
    domain, hint = domains.domain_of(cls, name), typing.get_type_hints(cls)[name]
    if hint is bool or hint == Optional[bool]:
        text = "`true`, `false`"
    elif isinstance(domain, (domains.Free, domains.Checked)) or domain is None:
        return ""
    else:
        text = domain.allowed()
    nullable = hint is not Any and type(None) in typing.get_args(hint)
    return f"{text}, or `null`" if nullable and text else text


def _type(hint: Any) -> str:
    if hint is Any:
        return "any"
    if isinstance(hint, type) and not getattr(hint, "__args__", None):
        return hint.__name__
    text = str(hint).replace("typing.", "")
    if text.startswith("Optional["):
        return f"{_type_name(text[len('Optional[') : -1])} or null"
    return _type_name(text)


def _type_name(text: str) -> str:
    return text.replace("Any", "any").replace("[", " of ").replace("]", "").replace(", ", " → ")


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def _value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)) and not value:
        return "{}" if isinstance(value, dict) else "[]"
    return str(value)


def _default_config(overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    schema.register_schema()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="config", overrides=list(overrides))
    return OmegaConf.to_container(cfg, resolve=False)  # type: ignore[return-value]


def _lookup(config: dict[str, Any], key: str) -> Any:
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return "(required)"
        node = node[part]
    return node


def rows(
    cls: type,
    prefix: str,
    docs: dict[tuple[str, str], str],
    config: dict[str, Any],
    missing: list[str],
) -> list[tuple[str, str, str, str, str]]:
    """(key, type, default, allowed, doc) for every field of `cls` and its nested sections."""
    out = []
    hints = typing.get_type_hints(cls)  # Annotated[...] stripped: the type alone
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default  # type: ignore[misc]
        if dataclasses.is_dataclass(default):
            out += rows(type(default), f"{key}.", docs, config, missing)
            continue
        doc = next(
            (docs[(c.__name__, f.name)] for c in cls.__mro__ if (c.__name__, f.name) in docs), None
        )
        if doc is None:
            missing.append(key)
        hint = hints[f.name]
        value = _lookup(config, key)
        shown = (
            "(a `_target_` config)"
            if isinstance(value, dict) and "_target_" in value
            else _value(value)
        )
        out.append((key, _type(hint), shown, allowed(cls, f.name), doc or ""))
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(title: str, section: list[tuple[str, str, str, str, str]]) -> list[str]:
    return [
        "",
        f"## {title}",
        "",
        "| key | type | default | allowed | what it does |",
        "| --- | --- | --- | --- | --- |",
        *(f"| `{k}` | {t} | `{_cell(d)}` | {a} | {_cell(doc)} |" for k, t, d, a, doc in section),
    ]


def render() -> tuple[str, list[str]]:
    """The page's text, and the keys that have no doc."""
    docs = field_docs(Path(schema.__file__).read_text())
    config = _default_config()
    missing: list[str] = []
    lines = [
        "# Configuration reference",
        "",
        "Generated from `src/hydra_ddp/config/schema.py` by `python -m "
        "hydra_ddp.tools.config_reference`: do not edit by hand (a test fails when it "
        "is out of date or a field has no doc). Each key is set on the command "
        "line (`python train.py trainer.epochs=3`) or in `conf/`. **default** "
        "is the default run's value, as `conf/config.yaml` composes it.",
        "",
        "## Config groups",
        "",
        "Chosen by name (`python train.py strategy=fsdp`); each option is `conf/GROUP/NAME.yaml`.",
        "",
        "| group | options | builds |",
        "| --- | --- | --- |",
    ]
    for group in (*NAMED_GROUPS, *TARGET_GROUPS, "debug", "experiment", "hparams_search"):
        builds = (
            "the section of the same name below"
            if group in NAMED_GROUPS
            else "a `_target_` object: your own class too"
            if group in TARGET_GROUPS
            else {
                "debug": "a debugging preset (overrides)",
                "experiment": "a whole experiment (`+experiment=NAME`)",
                "hparams_search": "an Optuna search (`-m`, search.md)",
            }[group]
        )
        lines.append(f"| `{group}` | {', '.join(f'`{o}`' for o in _options(group))} | {builds} |")
    top = {f.name: f for f in dataclasses.fields(schema.Config)}
    for name, f in top.items():
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None  # type: ignore[misc]
        chosen = domains.domain_of(schema.Config, name)
        if isinstance(chosen, domains.Chosen):  # a section per option: the strategy's settings
            for option, settings in chosen.options().items():
                docs.update(field_docs(inspect.getsource(sys.modules[settings.__module__])))
                section = rows(
                    settings, f"{name}.", docs, _default_config((f"{name}={option}",)), missing
                )
                lines += _table(f"`{name}={option}`", section)
        elif dataclasses.is_dataclass(default):
            lines += _table(f"`{name}`", rows(type(default), f"{name}.", docs, config, missing))
    eval_only = [f for f in dataclasses.fields(schema.EvalConfig) if f.name not in top]
    lines += [
        "",
        "## `eval.py` only",
        "",
        "| key | type | default | allowed | what it does |",
        "| --- | --- | --- | --- | --- |",
    ]
    for f in eval_only:
        doc = docs.get(("EvalConfig", f.name))
        if doc is None:
            missing.append(f"eval.{f.name}")
        default = (
            "(required)"
            if f.default is dataclasses.MISSING or f.default == "???"
            else _value(f.default)
        )
        hint = typing.get_type_hints(schema.EvalConfig)[f.name]
        lines.append(
            f"| `{f.name}` | {_type(hint)} | `{default}` | "
            f"{allowed(schema.EvalConfig, f.name)} | {_cell(doc or '')} |"
        )
    return "\n".join(lines) + "\n", missing


def main(argv: list[str]) -> int:
    text, missing = render()
    if missing:
        print(
            f"hydra-ddp: error: schema fields with no doc comment: {', '.join(missing)}",
            file=sys.stderr,
        )
        return 1
    if "--check" in argv:
        if not OUT.exists() or OUT.read_text() != text:
            print(
                f"hydra-ddp: error: {OUT.relative_to(REPO)} is out "
                "of date: run python -m hydra_ddp.tools.config_reference",
                file=sys.stderr,
            )
            return 1
        return 0
    if not (REPO / "docs").is_dir():  # an installed package: no docs/ to write into
        print(text, end="")
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"hydra-ddp: wrote {OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
