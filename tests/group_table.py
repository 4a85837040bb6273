"""docs/usage.md's table of config groups: its options column made from conf/, each group's options
with its default (conf/config.yaml's defaults list) named, the rest in name order. A group added,
an option added or gone, or a default changed changes the page: tests/unit/test_docs.py keeps the
two equal.

    python tests/group_table.py           # each group's options cell
    python tests/group_table.py --write   # written into docs/usage.md's table
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
CONF = REPO / "conf"
PAGE = REPO / "docs" / "usage.md"
# the groups a command picks from (hydra/ is Hydra's own; hparams_search's one search is in
# docs/search.md)
GROUPS = (
    "backend",
    "init_method",
    "launcher",
    "strategy",
    "task",
    "model",
    "data",
    "optim",
    "scheduler",
    "logger",
    "debug",
    "experiment",
)
ROW = re.compile(r"^\| `(?P<group>\w+)` \| (?P<options>[^|]*) \|(?P<rest>.*)$", re.M)


def defaults() -> dict[str, Any]:
    """{group: its default option (a list for several, None for none)}, from conf/config.yaml."""
    found: dict[str, Any] = {}
    for entry in yaml.safe_load((CONF / "config.yaml").read_text())["defaults"]:
        if isinstance(entry, dict):
            found.update(entry)
    return found


def cell(group: str) -> str:
    """The group's options as the table shows them."""
    names = sorted(path.stem for path in (CONF / group).glob("*.yaml"))
    chosen = defaults().get(group)
    chosen = [chosen] if isinstance(chosen, str) else list(chosen or [])
    first = [f"`{name}`" for name in chosen]
    rest = [f"`{name}`" for name in names if name not in chosen]
    if not first:
        return "none by default; " + ", ".join(rest)
    default = " and ".join(first) + (" (default, together)" if len(first) > 1 else " (default)")
    return ", ".join([default, *rest])


def cells() -> dict[str, str]:
    return {group: cell(group) for group in GROUPS}


HEADER = "| group | options | builds |"


def _table(text: str) -> tuple[int, int]:
    """Where the page's table of groups starts and ends: its header, to the first line after it
    that is no table row."""
    start = text.index(HEADER)
    end = text.find("\n\n", start)
    return start, end if end >= 0 else len(text)


def written() -> dict[str, str]:
    """{group: its options cell} as docs/usage.md's table shows them."""
    text = PAGE.read_text()
    start, end = _table(text)
    return {m["group"]: m["options"].strip() for m in ROW.finditer(text[start:end])}


def write() -> None:
    made, text = cells(), PAGE.read_text()
    start, end = _table(text)
    table = ROW.sub(
        lambda m: f"| `{m['group']}` | {made.get(m['group'], m['options'].strip())} |{m['rest']}",
        text[start:end],
    )
    PAGE.write_text(text[:start] + table + text[end:])


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write()
    for group, options in cells().items():
        print(f"{group}: {options}")
