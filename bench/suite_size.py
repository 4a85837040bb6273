"""The suite's size at a commit: tests collected per layer and `assert` statements in tests/.

    python bench/suite_size.py                 # the working tree
    python bench/suite_size.py c5792a6 HEAD    # commits (checked out into a temporary worktree)

What "nothing lost" is measured by when tests are merged or moved (docs/testing.md): the number
of tests each layer collects (pytest --collect-only, as `make test` selects them: the `look`
marker left out) and the assert statements in the test modules and the kit, counted in their
syntax trees (a loop's assert counts once). Prints one JSON object per commit.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def asserts(tests: Path) -> dict[str, int]:
    counts = {"unit": 0, "e2e": 0, "kit": 0}
    for path in sorted(tests.rglob("*.py")):
        relative = path.relative_to(tests).parts
        where = relative[0] if relative[0] in ("unit", "e2e") else "kit"
        tree = ast.parse(path.read_text(), filename=str(path))
        counts[where] += sum(isinstance(node, ast.Assert) for node in ast.walk(tree))
    return counts


def collected(root: Path, layer: str) -> int:
    env = {**os.environ, "PYTHONPATH": str(root / "src"), "CI": ""}
    env.pop("HDDP_DURATIONS_DIR", None)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            f"tests/{layer}",
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    ).stdout
    return sum(1 for line in out.splitlines() if "::" in line)


def size(root: Path, label: str) -> dict:
    tests = {layer: collected(root, layer) for layer in ("unit", "e2e")}
    counted = asserts(root / "tests")
    return {
        "commit": label,
        "tests": {**tests, "all": sum(tests.values())},
        "asserts": {**counted, "all": sum(counted.values())},
    }


def main(commits: list[str]) -> None:
    if not commits:
        import provenance

        print(json.dumps(size(REPO, provenance.stamp())))
        return
    for commit in commits:
        with tempfile.TemporaryDirectory() as folder:
            tree = Path(folder) / "tree"
            subprocess.run(
                ["git", "worktree", "add", "--detach", "-q", str(tree), commit],
                cwd=REPO,
                check=True,
            )
            try:
                label = subprocess.run(
                    ["git", "rev-parse", "--short", commit],
                    cwd=REPO,
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout.strip()
                print(json.dumps(size(tree, label)))
            finally:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO)


if __name__ == "__main__":
    main(sys.argv[1:])
