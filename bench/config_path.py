"""Follow the config from train.py to the loop: which modules it enters, how often, and how many
calls return across modules on the way (issue 47's measure of a config path that goes one way).
From the worker on (training/worker.py), how often the path climbs back to a higher floor: the
layers of tests/unit/test_architecture.py's LAYERS, the commit's own (issue 75's measure).

One rank, launched "from outside" (RANK/WORLD_SIZE set, as torchrun does), so the command and the
worker run in this one traced process. A call counts when it crosses into another module of the
project with the config (the composed DictConfig, the resolved config or one of its sections, typed
or plain) among its arguments; the trace stops at the loop's first step.

    python bench/config_path.py [--repo DIR] [--out bench/results/config_path_COMMIT.json]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import provenance

TRACER = r"""
import collections, json, runpy, sys, threading
from pathlib import Path

REPO = Path(sys.argv[1]).resolve()
OUT = sys.argv[2]
sys.argv = ["train.py", *sys.argv[3:]]
sys.path.insert(0, str(REPO))
ROOTS = (str(REPO / "src" / "hydra_ddp") + "/", str(REPO / "train.py"))
entries, returns, order = collections.Counter(), collections.Counter(), []


def module_of(filename):
    if filename == ROOTS[1]:
        return "train.py"
    if filename.startswith(ROOTS[0]):
        return filename[len(ROOTS[0]):]
    return None


def carries_config(frame):
    # Not imported from here: a profile function that imports while a module is half imported (the
    # first calls come from dataclasses' own import) fails and is switched off. No DictConfig exists
    # before omegaconf is imported.
    omegaconf = sys.modules.get("omegaconf")
    DictConfig = getattr(omegaconf, "DictConfig", ())
    code = frame.f_code
    for name in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]:
        value = frame.f_locals.get(name)
        if isinstance(value, DictConfig) or (isinstance(value, dict) and "trainer" in value):
            return True
        if any(c.__name__ == "Section" for c in type(value).__mro__):
            return True
    return False


def caller_module(frame):
    frame = frame.f_back
    while frame is not None:
        found = module_of(frame.f_code.co_filename)
        if found:
            return found
        frame = frame.f_back
    return None


class Done(Exception):
    pass


def profile(frame, event, arg):
    module = module_of(frame.f_code.co_filename)
    if module is None:
        return
    if module == "training/step.py" and event == "call" and frame.f_code.co_name == "run":
        sys.setprofile(None)
        counts = {"entries": entries, "returns": sum(returns.values()), "order": order}
        json.dump(counts, open(OUT, "w"), indent=1)
        raise Done
    if frame.f_code.co_name.startswith("__") or frame.f_code.co_name == "<module>":
        return  # an object's own machinery (a section's __setattr__), or an import
    if event == "call" and caller_module(frame) != module and carries_config(frame):
        entries[module] += 1
        order.append(f"{module}:{frame.f_code.co_name}")
        frame.f_trace_lines = False
    elif event == "return" and caller_module(frame) not in (module, None) and carries_config(frame):
        returns[module] += 1
        order.append(f"return {module} → {caller_module(frame)}")


sys.setprofile(profile)
try:
    runpy.run_path(str(REPO / "train.py"), run_name="__main__")
except (Done, SystemExit):
    pass
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def floors(repo: Path) -> dict[str, int]:
    """Each unit's layer (a subpackage, or a module at the package's top), as the commit's
    architecture test states them."""
    source = (repo / "tests" / "unit" / "test_architecture.py").read_text()
    layers = next(
        node.value
        for node in ast.parse(source).body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "LAYERS"
    )
    return {unit: i for i, layer in enumerate(ast.literal_eval(layers)) for unit in layer}


def climbs_from_the_worker(order: list[str], layer_of: dict[str, int]) -> dict:
    """The path from the worker's first entry to the loop's first step, on the floors: the times
    the next entry stands on a higher floor than the one before (the config handed back up instead
    of on down), and the calls that carry the config and return to a module on a higher floor."""

    def floor(module: str) -> int:
        return layer_of[module.split(":")[0].split("/")[0].removesuffix(".py")]

    start = next(i for i, entry in enumerate(order) if entry.startswith("training/worker.py:"))
    walk = [entry for entry in order[start:] if not entry.startswith("return ")]
    climbs = [f"{a} → {b}" for a, b in zip(walk, walk[1:]) if floor(b) > floor(a)]
    returns = [e.removeprefix("return ").split(" → ") for e in order[start:] if e[:7] == "return "]
    back_up = [f"{a} → {b}" for a, b in returns if floor(b) > floor(a)]
    return {
        "from_worker_entries": len(walk),
        "climbs_from_worker": len(climbs),
        "climbs": climbs,
        "returns_to_a_higher_floor_from_worker": len(back_up),
        "returns_to_a_higher_floor": back_up,
    }


def measure(repo: Path) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "path.json"
        env = {
            **os.environ,
            "PYTHONPATH": str(repo / "src"),
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
        }
        overrides = ["trainer.max_steps=1", "logger=[csv]", f"hydra.run.dir={scratch}/run"]
        subprocess.run(
            [sys.executable, "-c", TRACER, str(repo), str(out), *overrides],
            cwd=repo,
            env=env,
            check=False,
            timeout=600,
        )
        found = json.loads(out.read_text())
    entries = found["entries"]
    return {
        "modules": len(entries),
        "entries": sum(entries.values()),
        "most_entered": max(entries.values()),
        "entered_more_than_twice": {m: n for m, n in entries.items() if n > 2},
        "returns_across_modules": found["returns"],
        "per_module": dict(sorted(entries.items())),
        **climbs_from_the_worker(found["order"], floors(repo)),
        "order": [entry for entry in found["order"] if not entry.startswith("return ")],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = {"commit": provenance.stamp(args.repo.resolve()), **measure(args.repo.resolve())}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
