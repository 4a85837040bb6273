"""`hydra-ddp init DIR`: a small project that trains at once, upgraded with pip, not merged.

The files are hydra_ddp/template/ (a package of plain files, no template engine: {{name}},
{{package}} and {{version}} are the only substitutions, and a directory named PACKAGE becomes the
project's package); copier or cookiecutter would add a dependency for what one function does.
"""

from __future__ import annotations

import keyword
import re
from importlib import metadata
from pathlib import Path

from hydra_ddp.errors import UserError

TEMPLATE = Path(__file__).with_name("template")


def package_name(folder: Path) -> str:
    """The project's import name, from its directory's: lower case, - and spaces as _."""
    name = re.sub(r"\W", "_", folder.name.lower().replace("-", "_"))
    name = name if name and not name[0].isdigit() else f"project_{name}"
    return f"{name}_" if keyword.iskeyword(name) else name


def init(target: str) -> tuple[Path, list[Path]]:
    """Write the project into `target` (made if absent; it must be empty): its folder, the files
    written."""
    folder = Path(target).expanduser().resolve()
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise UserError(
            f"hydra-ddp init {target}: {folder} is not an empty directory; give a new or empty one"
        )
    package = package_name(folder)
    try:
        version = metadata.version("hydra-ddp")
    except metadata.PackageNotFoundError:  # a clone not installed: any release will do
        version = "0.1"
    values = {"{{name}}": folder.name, "{{package}}": package, "{{version}}": version}
    # The package's folder takes the project's name; .gitignore ships without its dot (a package's
    # data is found by glob, which passes over dotfiles).
    RENAMED = {"PACKAGE": package, "gitignore": ".gitignore"}
    written = []
    for source in sorted(TEMPLATE.rglob("*")):
        if source.is_dir() or "__pycache__" in source.parts:
            continue
        relative = Path(*(RENAMED.get(part, part) for part in source.relative_to(TEMPLATE).parts))
        text = source.read_text()
        for key, value in values.items():
            text = text.replace(key, value)
        destination = folder / relative
        destination.parent.mkdir(parents=True, exist_ok=True)
        destination.write_text(text)
        written.append(destination)
    return folder, written
