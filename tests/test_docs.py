"""The docs cannot drift: the config reference is the schema's, and every shell command in README.md
and docs/ runs here, or its block is marked as needing what this machine lacks.

A block is marked by an HTML comment on the line before its fence: `<!-- doc-test: needs-gpu -->`
or `<!-- doc-test: needs-cluster -->` (several hosts, Slurm, Kubernetes). The others run:

- `train.py` and `eval.py`, however launched (python, torchrun, mpirun, sbatch with the project's
  script, `make train ARGS=...`, the tuners' train.py overrides): composed, resolved and checked
  exactly as `train.py --check` does (the same code: preflight.check; a GPU host's command as
  `--check --gpus=N`), a sweep's first value and a search's space left to the sweeper;
  placeholders (a run's DATE/TIME, DIR, /data/cifar, ~/lab) stand for fixtures made here: a tiny
  real run, CIFAR-10 files, an image folder, the user's package of tests/test_tasks.py;
- `python -m hydra_ddp.export`: run for real against the tiny run;
- shell variables a block sets (`export X=...`, `X=...`) expand in its later lines;
- `make TARGET`: the target exists (`make -n`); `pip install -e '.[EXTRA]'`: the extra exists;
- a tool the docs open a run with (tensorboard, mlflow, wandb): it is installed in the venv
  (tests/test_ui.py serves the first two as the docs give them).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import textwrap

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, before the standard library took it in
    import tomli as tomllib  # type: ignore[no-redef]

from pathlib import Path

import pytest

from support import QUICK, REPO, check_ok, run_train, train_env

# docs/index.md is README.md's copy, made by `make docs`.
PAGES = [REPO / "README.md", *sorted(p for p in (REPO / "docs").rglob("*.md") if p.name != "index.md")]
SHELLS = ("bash", "sh", "shell", "console")
MARKS = ("needs-gpu", "needs-cluster")
VENV_TOOLS = ("tensorboard", "mlflow", "wandb")


def shell_blocks(path: Path) -> list[tuple[int, str | None, list[str]]]:
    """(line, mark, commands) for each shell block of a page: continuation lines joined."""
    blocks, lines = [], path.read_text().split("\n")
    i = 0
    while i < len(lines):
        fence = re.match(r"^(\s*)```(\w*)", lines[i])
        if not fence:
            i += 1
            continue
        lang, start = fence.group(2), i
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith("```"):
            body.append(lines[i])
            i += 1
        i += 1
        if lang not in SHELLS:
            continue
        before = "\n".join(lines[max(0, start - 2):start])
        mark = next((m for m in MARKS if f"doc-test: {m}" in before), None)
        commands, current = [], ""
        for line in body:
            current += line.rstrip("\\").rstrip() + " " if line.rstrip().endswith("\\") else line
            if not line.rstrip().endswith("\\"):
                if current.strip() and not current.strip().startswith("#"):
                    commands.append(current.strip())
                current = ""
        blocks.append((start + 1, mark, commands))
    return blocks


def _words(command: str) -> list[str]:
    return shlex.split(command, comments=True)


def _train_overrides(words: list[str]) -> tuple[list[str], int | None]:
    """A train.py command's overrides as one job checks them, and --gpus=N if given."""
    gpus, overrides = None, []
    for word in words:
        if word.startswith("--gpus="):
            gpus = int(word.split("=", 1)[1])
        elif word.startswith("-"):  # -m, --check, --cfg job, ...: the job's config is what is checked
            continue
        elif "=" in word:
            key, value = word.split("=", 1)
            if re.match(r"^(interval|choice|range|tag)\(", value) or key.startswith(
                    ("hydra.sweeper", "hydra.launcher", "hydra.sweep.", "hydra.run.", "tune.")):
                continue  # the sweeper's, the launcher's and the tuner's own
            if "," in value and not value.startswith(("[", "{", "'", '"')):
                value = value.split(",")[0]  # a sweep: its first job
            overrides.append(f"{key}={value}")
    return overrides, gpus


def _commands():
    for page in PAGES:
        for line, mark, commands in shell_blocks(page):
            for command in commands:
                yield page, line, mark, command


COMMANDS = list(_commands())


def test_the_docs_have_shell_blocks_and_every_mark_is_known():
    assert len(COMMANDS) > 40  # README.md and docs/: the test reads them
    for page in PAGES:
        for found in re.findall(r"doc-test: ([\w-]+)", page.read_text()):
            assert found in MARKS, f"{page.name}: unknown doc-test mark {found!r} (one of {MARKS})"


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory) -> dict[str, Path]:
    """What the docs' placeholders stand for: a tiny real run (eval.py's and the exporter's
    checkpoint, a fine-tune's init_from), CIFAR-10 files, an image folder, a user's own package."""
    from support import make_image_folder, write_cifar
    from test_tasks import LAB

    base = tmp_path_factory.mktemp("docs")
    check_ok(run_train(base / "run", *QUICK))
    home = base / "home"
    for name, text in LAB.items():
        (home / "lab" / name).parent.mkdir(parents=True, exist_ok=True)
        (home / "lab" / name).write_text(textwrap.dedent(text))  # as tests/test_tasks.py writes them
    return {"run": base / "run", "cifar": write_cifar(base / "cifar"), "images": make_image_folder(base / "images"),
            "home": home}


def _expand(command: str, env: dict[str, str], home: Path) -> str:
    """$VAR, ${VAR} and ~ as the shell would, from the block's own assignments and a fake home."""
    command = re.sub(r"(^|[\s=:\[])~(?=/)", lambda m: m.group(1) + str(home), command)
    return re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), str(home) if m.group(1) == "HOME" else m.group(0)),
                  command)


def _placeholders(words: list[str], fx: dict[str, Path]) -> list[str]:
    """The docs' placeholders (DATE/TIME runs, DIR, /data/cifar, N) as this test's fixtures."""
    out = []
    for word in words:
        key, _, value = word.partition("=")
        if "DATE/TIME" in value or key == "ckpt":
            word = f"{key}={fx['run']}"
        elif key == "data.dataset.root":
            word = f"{key}={fx['images'] if any('imagefolder' in w for w in words) else fx['cifar']}"
        elif key == "data.num_classes" and value == "N":
            word = f"{key}=2"
        out.append(word)
    if any(w in ("data=cifar10", "+experiment=cifar10_resnet18") for w in out) and not any(
            w.startswith("data.dataset.root=") for w in out):
        out.append(f"data.dataset.root={fx['cifar']}")
    return out


def _after(words: list[str], script: str) -> list[str] | None:
    """The arguments after `script` (train.py, a .sbatch file) in a launcher's command line."""
    for i, word in enumerate(words):
        if word == script or word.endswith("/" + script) or (script == ".sbatch" and word.endswith(".sbatch")):
            return words[i + 1:]
    return None


@pytest.mark.timeout(600)
def test_every_shell_command_in_the_docs_runs(fixtures: dict[str, Path], tmp_path: Path, monkeypatch):
    from hydra_ddp.launch import preflight

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    failures, ran, env, block = [], 0, {}, None

    def check(overrides: list[str], name: str, config_name: str = "config") -> None:
        overrides, gpus = _train_overrides(_placeholders(overrides, fixtures))
        if any(o in ("backend=nccl", "trainer.device=cuda") for o in overrides) and gpus is None:
            nproc = next((o.split("=")[1] for o in overrides if o.startswith("trainer.nproc=")), "8")
            gpus = int(nproc) if nproc.isdigit() else 8  # a GPU host's command: checked as --check --gpus=N does
        preflight.check(REPO / "conf", overrides, tmp_path / name, gpus=gpus, config_name=config_name)

    for page, line, mark, command in COMMANDS:
        if mark:
            continue
        if (page, line) != block:  # a block's variables are its own
            block, env = (page, line), {}
        where = f"{page.relative_to(REPO)}:{line}: {command}"
        try:
            words = _words(_expand(command, env, fixtures["home"]))
            if not words:
                continue
            assignment = re.match(r"^(?:export\s+)?(\w+)=(.*)$", " ".join(words))
            if assignment and len(words) <= 2 and (words[0] == "export" or "=" in words[0]):
                env[assignment.group(1)] = assignment.group(2)
                if assignment.group(1) == "PYTHONPATH":
                    for folder in assignment.group(2).split(":"):
                        monkeypatch.syspath_prepend(folder)
                ran += 1
                continue
            program = Path(words[0]).name
            if program == "make":
                target = words[1] if len(words) > 1 and "=" not in words[1] else "all"
                args = next((w.split("=", 1)[1] for w in words if w.startswith("ARGS=")), "")
                assert subprocess.run(["make", "-n", target], cwd=REPO, capture_output=True, timeout=60).returncode == 0, \
                    f"no make target {target!r}"
                if target == "train":
                    check(shlex.split(args), f"run{ran}")
            elif program == "pip" or words[:3] == ["python", "-m", "pip"]:
                for extra in re.findall(r"\.\[([\w,-]+)\]", command):
                    for name in extra.split(","):
                        assert name in extras, f"pyproject.toml has no extra {name!r}"
            elif program in VENV_TOOLS:
                assert (Path(sys.executable).parent / program).exists(), f"{program} is not installed by the project"
            elif program == "sbatch":
                script = next(w for w in words if w.endswith(".sbatch"))
                assert (REPO / script).exists(), f"no {script}"
                check(_after(words, ".sbatch"), f"run{ran}")
            elif _after(words, "train.py") is not None:  # python, torchrun, torch.distributed.launch, mpirun
                check(_after(words, "train.py"), f"run{ran}")
            elif _after(words, "eval.py") is not None:
                check(_after(words, "eval.py"), f"eval{ran}", "eval")
            elif words[1:3] in (["-m", "hydra_ddp.tools.tune"], ["-m", "hydra_ddp.tools.tune_loader"]):
                check(words[3:], f"run{ran}")
            elif words[1:3] == ["-m", "hydra_ddp.export"]:
                args = [f"out={tmp_path / 'export' / Path(w.split('=', 1)[1]).name}" if w.startswith("out=") else w
                        for w in _placeholders(words[3:], fixtures)]
                if not any(a.startswith("out=") for a in args):
                    args.append(f"out={tmp_path / 'export' / 'model.safetensors'}")
                proc = subprocess.run([sys.executable, "-m", "hydra_ddp.export", *args], cwd=tmp_path, env=train_env(),
                                      capture_output=True, text=True, timeout=120)
                assert proc.returncode == 0, proc.stderr.strip()
            else:
                raise AssertionError("a command the doc test does not know how to run: run it here, or mark its "
                                     "block doc-test: needs-gpu / needs-cluster")
            ran += 1
        except Exception as error:  # noqa: BLE001  (every failing command listed at once)
            first = str(error).strip().splitlines()[0] if str(error).strip() else ""
            failures.append(f"{where}\n    → {type(error).__name__}: {first}")
    assert not failures, f"{len(failures)} command(s) in the docs fail:\n" + "\n".join(failures)
    assert ran > 30


def test_the_config_reference_is_the_schemas_and_every_field_has_a_doc():
    from hydra_ddp.config import reference

    text, missing = reference.render()
    assert not missing, f"schema fields with no doc comment (add one above the field): {missing}"
    assert reference.OUT.read_text() == text, "docs/reference/config.md is out of date: python -m hydra_ddp.config.reference"


def test_the_reference_lists_every_key_of_the_default_config():
    """Every leaf of the default run's composed config (outside the `_target_` groups) has a row."""
    from hydra_ddp.config import reference

    config, text = reference._default_config(), reference.OUT.read_text()

    def leaves(node, prefix=""):
        for key, value in node.items():
            dotted = f"{prefix}{key}"
            if dotted in ("task", "model", "optim", "scheduler", "logger", "data.dataset"):
                continue  # `_target_` objects: their keys are the user's class's (the groups table lists them)
            if isinstance(value, dict) and value:
                yield from leaves(value, f"{dotted}.")
            else:
                yield dotted

    absent = [key for key in leaves(config) if f"| `{key}` |" not in text]
    assert not absent, absent
