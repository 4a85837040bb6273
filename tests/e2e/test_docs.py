"""The docs cannot drift: every shell command in README.md and docs/ runs here for real (their
fences, marks and the config reference are checked in process by tests/unit/test_docs.py; the
blocks are read by the kit, support.blocks).

Every command of a `bash` block runs as written, by bash, in a project folder made for the test
(`project`: the repository's train.py, eval.py, conf/, scripts/, Makefile, setup.py and .venv,
linked), with the block's own variables, and with only a small-run suffix appended (SUFFIXES: two
training steps, two search trials, a short tuning, a free port for a server). Launchers run as they
are given: torchrun, torch.distributed.launch, mpirun, sbatch (on the suite's own Slurm cluster,
tests/slurm), submitit's local launcher; the two commands of a two-node pair run at once; a sweep
runs every value. A server (tensorboard, mlflow ui) is started, asked for a page and stopped. A
command that composes the same config as one already run (the same words, or the same composed
config for a plain train.py run) runs once.

The docs' placeholders are real in the project folder: `outputs/runs/DATE/TIME` is a finished run
there, `path/to/step-00000100.pt` one of its checkpoints, `data/` holds CIFAR-10's files, `~` is a
home with the user's package of docs/tasks.md in `~/lab`. A few stand for what no folder can be,
and are replaced (PLACEHOLDERS): `node0` (node 0's host), `/shared/...` (a shared file system),
`/data/cifar`, `DIR` and `N` (your images and their classes).

A block that cannot run here is marked by an HTML comment on the line before its fence,
`<!-- doc-test: MARK -->` with a MARK of MARKS (docs/testing.md lists them): it is skipped, or for
`installs`, checked only (the extras it installs are the project's). The test prints
how many commands ran, how many were checked only (the marked `installs`) and how many were
skipped, by mark.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest

import doc_map
import servers
from support import (
    BLOCKS,
    QUICK,
    REPO,
    SHELLS,
    check_ok,
    make_image_folder,
    run_train,
    train_env,
    without_comment,
    write_cifar,
    write_lab,
)

TIMEOUT_S = 300  # one command, a sweep or a pair of nodes included
# The tuner launches a training per candidate (15 for docs/tune.md's ResNet-18, one at two threads
# per rank on two cores): 130 s beside the soak's CPU hog, and past 300 s in one soak run (f4d87dc's
# first). A bound that tells a hang from a slow machine, not a time the test asserts.
TUNER_TIMEOUT_S = 600


# --- The project folder the commands run in
# --------------------------------------------------------

PLACEHOLDERS = {  # what no folder can be: replaced, word by word
    r"\bnode0(?=:)": "127.0.0.1",  # node 0's host name: this machine
    # a file system every node shares, one per page: two pages' examples that name one folder
    # (README's sbatch and elastic.md's pair, both /shared/runs/exp1) are not one run
    r"(?<![\w/.])/shared/": "{project}/shared/{page}/",
    r"(?<![\w/.])/data/cifar\b": "{project}/data",  # your CIFAR-10 download
    r"\bdata\.dataset\.root=DIR\b": "data.dataset.root={images}",  # your image folder
    r"\bdata\.num_classes=N\b": "data.num_classes=2",  # its classes
}


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A folder to run the docs' commands in, as a user's clone would be after `make train`."""
    folder = tmp_path_factory.mktemp("project")
    for name in (
        "train.py",
        "eval.py",
        "conf",
        "scripts",
        "Makefile",
        "pyproject.toml",
        "setup.py",
        "src",
    ):
        (folder / name).symlink_to(REPO / name)
    (folder / ".venv").symlink_to(Path(sys.executable).parents[1])
    run = folder / "outputs" / "runs" / "DATE" / "TIME"
    check_ok(run_train(run, *QUICK, "checkpoint.every_n_steps=4"))
    (folder / "path" / "to").mkdir(parents=True)
    shutil.copy(run / "checkpoints" / "last.pt", folder / "path" / "to" / "step-00000100.pt")
    write_cifar(folder / "data")
    make_image_folder(folder / "images")
    write_lab(folder / "home" / "lab")
    return folder


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _program(words: list[str]) -> str:
    return Path(words[0]).name if words else ""


def _script(words: list[str]) -> Optional[str]:
    """train.py, eval.py, a tool's module, or what the command runs."""
    for i, word in enumerate(words):
        if word in ("train.py", "eval.py") or word.endswith(("/train.py", "/eval.py")):
            return Path(word).name
        if word == "-m" and i + 1 < len(words) and words[i + 1].startswith("hydra_ddp."):
            return words[i + 1]
    return None


def suffix(words: list[str]) -> list[str]:
    """SUFFIXES: what a small run of this command appends (nothing for one that launches
    nothing)."""
    script = _script(words)
    if {"--check", "--cfg", "--help", "--info"} & set(words):
        return []
    if script == "train.py":
        extra = ["trainer.max_steps=2"]
        if any(w.startswith("hparams_search=") for w in words):
            extra.append("hydra.sweeper.n_trials=2")
        return extra
    if script == "hydra_ddp.tools.tune":
        return ["tune.steps=4", "tune.repeats=1"]
    if script == "hydra_ddp.tools.tune_loader":
        return ["tune.batches=2", "tune.num_workers=[0,1]"]
    if _program(words) == "make" and "train" in words:
        return ["ARGS=trainer.max_steps=2"]
    if _program(words) == "sbatch" and any(w.endswith("train.sbatch") for w in words):
        return ["trainer.max_steps=2"]  # the script's arguments are train.py's
    if _program(words) in ("tensorboard", "mlflow"):
        return [f"--port={_free_port()}"]
    return []


SERVERS = {
    "tensorboard": "/data/runs",
    "mlflow": "/api/2.0/mlflow/experiments/search?max_results=1",
}


@dataclass
class Outcome:
    ran: int = 0
    distinct: int = 0
    mapped: int = 0  # run for real by another test (tests/doc_map.py)
    checked: int = 0
    gpu_checked: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    seen: set[str] = field(default_factory=set)
    failures: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # each distinct run's, for the report


def _placed(command: str, project: Path, page: str = "page") -> str:
    for pattern, value in PLACEHOLDERS.items():
        placed = value.format(project=project, images=project / "images", page=page)
        command = re.sub(pattern, placed, command)
    return command


def _key(words: list[str], env_lines: list[str]) -> str:
    """What makes a command the same as another: its words after the block's variables, with the
    program's path left out; a plain train.py run's composed config."""
    normal = " ".join(["python" if w.endswith("/python") else w for w in words])
    plain = (
        _script(words) == "train.py"
        and _program(words) in ("python", "python3")
        and not any(w.startswith("-") for w in words[1:])
        and not env_lines
    )
    if plain:
        from hydra import compose, initialize_config_dir
        from omegaconf import OmegaConf

        overrides = words[2:]
        # where it runs: not in the job's config
        hydras = sorted(w for w in overrides if w.startswith("hydra"))
        try:
            with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
                composed = OmegaConf.to_container(
                    compose(config_name="config", overrides=overrides)
                )
            return "train.py " + json.dumps([composed, hydras], sort_keys=True, default=str)
        except Exception:  # noqa: BLE001  (the run itself will say)
            pass
    return normal + " | " + " ".join(env_lines)


def _expand(command: str, env_lines: list[str], project: Path, env: dict[str, str]) -> list[str]:
    """The command's words as bash makes them, after the block's assignments (variables, ~,
    quotes)."""
    script = "\n".join([*env_lines, f"set -- {command}", 'printf "%s\\0" "$@"'])
    out = subprocess.run(
        ["bash", "-c", script], cwd=project, env=env, capture_output=True, text=True, timeout=30
    ).stdout
    return out.split("\0")[:-1]


def _check_for_gpus(command: str, project: Path, env: dict[str, str]) -> Optional[str]:
    """A GPU host's `python train.py ...` checked as that host would check it (--check --gpus=N, N
    its trainer.nproc, else 8): its one error line, or "" when it passes; None for another
    command."""
    words = shlex.split(_placed(without_comment(command), project))
    at = next((i for i, word in enumerate(words) if word.endswith("train.py")), None)
    if at is None:
        return None
    gpus = next((w.split("=", 1)[1] for w in words if w.startswith("trainer.nproc=")), "8")
    checked = [*words[: at + 1], "--check", f"--gpus={gpus}", *words[at + 1 :]]
    done = subprocess.run(
        checked, cwd=project, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    return "" if done.returncode == 0 else f"exit {done.returncode}: {done.stderr.strip()[-400:]}"


def _start(script: str, project: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        ["bash", "-c", script],
        cwd=project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _finish(proc: subprocess.Popen, timeout: float, started: float) -> tuple[int, str, str]:
    """(exit code, stdout, stderr); a command past `timeout` is killed, and its message says where
    its output ended and where any of its runs was stuck (the stacks the ranks' watchdogs left in
    the tuner's runs since `started`, the command's start: a failed or killed one keeps its
    directory)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        found = Path(tempfile.gettempdir()).glob("hydra-ddp-tune-*/run-*/stacks/rank*.json")
        stuck = [
            json.loads(path.read_text())
            for path in sorted(found)
            if path.stat().st_mtime >= started
        ]
        places = [
            f"rank {s['rank']} at {s['at']} ({s['code']}, waiting in {s['waits_in']})"
            for s in stuck
        ]
        message = (
            f"timed out after {timeout:.0f} s; its output ended: {out.strip()[-300:]!r}; "
            f"stderr: {err.strip()[-300:]!r}; ranks stuck: {places or 'none seen'}"
        )
        return -9, "", message
    return proc.returncode, out, err


def _serve(script: str, path: str, port: int, project: Path, env: dict[str, str]) -> str:
    """Start a server as the docs give it, wait until it answers `path`; stop it. Empty: it
    answered."""
    import urllib.request

    proc = _start(script, project, env)
    deadline, problem = time.monotonic() + 120, f"no answer on port {port} within 120 s"
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return f"exited {proc.returncode} before answering: {proc.stderr.read()[-500:]}"
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{port}{path}", timeout=5
                ) as response:
                    json.loads(response.read())
                    return ""
            except OSError:
                time.sleep(0.5)
        return problem
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _sbatch(script: str, project: Path, env: dict[str, str]) -> str:
    """A job submitted as the docs give it, waited for on the suite's cluster; empty: it ran to the
    end."""
    code, out, err = _finish(_start(script, project, env), 60, time.time())
    job = re.search(r"Submitted batch job (\d+)", out)
    if code or not job:
        return f"sbatch exited {code}: {err.strip()[-500:]}"
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        queued = subprocess.run(
            ["squeue", "-h", "-j", job.group(1)],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
        if not queued:
            break
        time.sleep(1)
    else:
        subprocess.run(["scancel", job.group(1)], env=env, timeout=30)
        return f"job {job.group(1)} did not finish within {TIMEOUT_S} s"
    log = next(project.glob(f"slurm-*-{job.group(1)}.out"), None)
    text = log.read_text() if log else ""
    return (
        ""
        if "hydra-ddp: error" not in text and "Traceback" not in text and log
        else f"job {job.group(1)}: {text.strip()[-500:] or 'no output file'}"
    )


def _pairs(commands: list[str]) -> list[list[str]]:
    """The block's commands, a two-node pair (node_rank=0 then =1, else the same) as one group."""
    groups: list[list[str]] = []
    for command in commands:
        if (
            groups
            and "launcher.node_rank=1" in command
            and len(groups[-1]) == 1
            and "launcher.node_rank=0" in groups[-1][0]
        ):
            groups[-1].append(command)
        else:
            groups.append([command])
    return groups


_PATHS = re.compile(r"[\w.~-]*/[\w./~-]+")


def _needed_later(commands: list[str], at: int, claimed: dict[str, set[str]]) -> bool:
    """A command a later command of its block, run here, reads the outputs of (a path they share:
    the shards it writes, the run it trains): it runs here too, whoever else runs it."""
    made = set(_PATHS.findall(without_comment(commands[at]))) - {".venv/bin/python"}
    return any(
        doc_map.normal(later) not in claimed and made & set(_PATHS.findall(without_comment(later)))
        for later in commands[at + 1 :]
    )


@pytest.mark.timeout(3000)
def test_every_shell_command_in_the_docs_runs(
    project: Path, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture
):
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    outcome = Outcome()
    claimed = doc_map.claims()  # run for real by their own tests
    venv_bin = str(project / ".venv" / "bin")
    base_env = {
        **train_env(),
        "HOME": str(project / "home"),
        "PATH": f"{venv_bin}:{os.environ['PATH']}",
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "WANDB_MODE": "offline",
        "PYTHONPATH": train_env()["PYTHONPATH"],
    }
    for block in BLOCKS:
        if block.lang not in SHELLS or not block.commands:
            continue
        if block.mark == "installs":  # checked only: the extras it names are the project's
            for command in block.commands:
                outcome.checked += 1
                absent = [
                    name
                    for extra in re.findall(r"\.\[([\w,-]+)\]", command)
                    for name in extra.split(",")
                    if name not in extras
                ]
                if absent or "pip install" not in command:
                    outcome.failures.append(
                        f"{block.where}: {command}\n    → not a pip install of "
                        f"the project's extras (pyproject.toml has no {absent})"
                    )
            continue
        # a GPU host's train.py: checked for one (--check --gpus=N), launched nowhere
        if block.mark == "needs-gpu":
            for command in block.commands:
                problem = _check_for_gpus(command, project, base_env)
                if problem is None:
                    # not train.py (sbatch)
                    outcome.skipped[block.mark] = outcome.skipped.get(block.mark, 0) + 1
                    continue
                outcome.gpu_checked += 1
                if problem:
                    outcome.failures.append(f"{block.where}: {command}\n    → {problem}")
            continue
        if block.mark:
            outcome.skipped[block.mark] = outcome.skipped.get(block.mark, 0) + len(block.commands)
            continue
        env_lines: list[str] = []  # the block's assignments so far, replayed before each command
        at = 0
        for group in _pairs(block.commands):
            at += len(group)
            first = without_comment(group[0])
            if re.match(r"^(export\s+)?\w+=", first) and len(group) == 1:
                env_lines.append(_placed(first, project, block.page.stem))
                outcome.ran += 1
                continue
            scripts, key_words = [], []
            for command in group:
                placed = _placed(without_comment(command), project, block.page.stem)
                words = _expand(placed, env_lines, project, base_env)
                extra = suffix(words)
                scripts.append("\n".join([*env_lines, f"{placed} {shlex.join(extra)}".strip()]))
                # the same command on two pages is one run (its shared folder aside)
                mine = f"/shared/{block.page.stem}/"
                key_words.append([w.replace(mine, "/shared/") for w in words + extra])
            outcome.ran += len(group)
            key = " && ".join(_key(w, env_lines) for w in key_words)
            if key in outcome.seen:
                continue
            outcome.seen.add(key)
            outcome.distinct += len(group)
            if all(doc_map.normal(c) in claimed for c in group) and not _needed_later(
                block.commands, at - 1, claimed
            ):
                outcome.mapped += len(group)
                continue
            words = key_words[0]
            program = _program(words)
            where, began = f"{block.where}: {' / '.join(group)}", time.monotonic()
            if (
                program == "make"
                and subprocess.run(["make", "-q", ".venv/.installed"], cwd=REPO).returncode
            ):
                problem = (
                    "the venv is older than pyproject.toml: run "
                    "make first (make here would reinstall it)"
                )
            elif program in SERVERS:
                port = int(words[-1].split("=")[1])
                problem = _serve(scripts[0], SERVERS[program], port, project, base_env)
            elif program == "sbatch":
                cluster = request.getfixturevalue("slurm_cluster")
                problem = _sbatch(
                    scripts[0], project, {**base_env, **cluster.env, "PYTHON": sys.executable}
                )
            else:
                started = time.time()
                procs = [_start(script, project, base_env) for script in scripts]
                limit = TUNER_TIMEOUT_S if _script(words) == "hydra_ddp.tools.tune" else TIMEOUT_S
                results = [_finish(proc, limit, started) for proc in procs]
                problem = "; ".join(
                    f"exit {code}: {(err.strip() or out.strip())[-1000 if code == -9 else -400 :]}"
                    for code, out, err in results
                    if code
                )
            outcome.seconds[where] = time.monotonic() - began
            if problem:
                outcome.failures.append(f"{where}\n    → {problem}")
    with capsys.disabled():
        skipped = ", ".join(f"{n} {mark}" for mark, n in sorted(outcome.skipped.items()))
        print(
            f"\ndocs: {outcome.ran} commands read, {outcome.distinct - outcome.mapped} distinct "
            f"runs made here, {outcome.mapped} run by their own tests (the doc map), "
            f"{outcome.checked} checked only (marked installs), "
            f"{outcome.gpu_checked} checked for a GPU host (train.py --check "
            f"--gpus=N), {sum(outcome.skipped.values())} skipped ({skipped})"
        )
        slowest = sorted(outcome.seconds.items(), key=lambda item: -item[1])[:8]
        print(
            f"docs: the runs took {sum(outcome.seconds.values()):.0f} s; the slowest:\n"
            + "\n".join(f"  {seconds:6.1f} s  {where[:110]}" for where, seconds in slowest)
        )
    assert not outcome.failures, (
        f"{len(outcome.failures)} command(s) in the docs fail:\n" + "\n".join(outcome.failures)
    )
    # runs, each once (not an assignment, not a repeat), here or by their tests
    assert outcome.distinct > 60 and outcome.distinct - outcome.mapped > 20


@pytest.mark.timeout(600)
def test_every_transcript_in_the_docs_prints_what_it_shows(project: Path):
    # A `text` block's `$ command` lines run, and each line the page shows the command printing
    # that is the project's own (hydra-ddp: ...) must be in what it prints, word for word.
    compared = 0
    for block in BLOCKS:
        if block.lang != "text" or block.mark or not block.transcript:
            continue
        for command, shown in block.transcript:
            done = subprocess.run(
                ["bash", "-c", _placed(command, project)],
                cwd=project,
                env=train_env(),
                capture_output=True,
                text=True,
                timeout=TIMEOUT_S,
            )
            printed = (done.stdout + done.stderr).splitlines()
            for line in (line for line in shown if line.startswith("hydra-ddp:")):
                assert line in printed, (
                    f"{block.where}: `{command}` printed {printed[-5:]}, the page shows {line!r}"
                )
                compared += 1
    assert compared >= 3  # the tutorial's, at least


def _first_of_sweeps(words: list[str]) -> list[str]:
    """A multirun's overrides as its first job composes them: each swept key's first value (Hydra's
    `a=1,2`; a value in brackets or braces is one value)."""
    first = []
    for word in words:
        key, _, value = word.partition("=")
        if value and "," in value and not value.startswith(("[", "{", "'", '"')):
            value = value.split(",")[0]
        first.append(f"{key}={value}" if value else word)
    return first


def _documented_runs(project: Path) -> list[tuple[str, str, list[str], Optional[str]]]:
    """Every documented train.py and eval.py command, as (where, script, its overrides, the GPUs of
    the host it is for): its block's variables expanded, its placeholders made real, a sweep as its
    first job, Hydra's own settings left out (but the search path)."""
    env = {**train_env(), "HOME": str(project / "home"), "PYTHONPATH": train_env()["PYTHONPATH"]}
    found = []
    for block in BLOCKS:
        if block.lang not in SHELLS or block.mark not in (None, "needs-gpu"):
            continue
        env_lines: list[str] = []
        for command in block.commands:
            placed = _placed(without_comment(command), project)
            if re.match(r"^(export\s+)?\w+=", placed):
                env_lines.append(placed)
                continue
            words = _expand(placed, env_lines, project, env)
            script = _script(words)
            if script not in ("train.py", "eval.py") or {"--cfg", "--help"} & set(words):
                continue
            at = next(i for i, w in enumerate(words) if w.endswith(script))
            gpus, overrides = None, []
            for word in words[at + 1 :]:
                if word.startswith("--gpus="):
                    gpus = word.split("=", 1)[1]
                elif not word.startswith("-") and (
                    not word.startswith(("hydra.", "hydra/")) or word.startswith("hydra.searchpath")
                ):
                    overrides.append(word)
            if block.mark == "needs-gpu":
                nproc = [w.split("=")[1] for w in overrides if w.startswith("trainer.nproc=")]
                gpus = nproc[0] if nproc else "8"
            found.append((f"{block.where}: {command}", script, _first_of_sweeps(overrides), gpus))
    return found


@pytest.mark.timeout(600)
def test_every_documented_command_composes_and_resolves_in_process(
    project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Every documented train.py and eval.py command (a GPU host's, for such a host; one that
    another test runs for real, too), cheaply: composed in this process as Hydra composes it, its
    placeholders made real, a sweep as its first job; then resolved as the command resolves it
    (every auto settled, every key's value in its domain, the batch sizes agreeing), eval.py's from
    its checkpoint. What the run itself checks of its files and data is the run's: the doc test
    above, or the command's runner."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from hydra_ddp.config.schema import register_schema
    from hydra_ddp.launch import resolve
    from hydra_ddp.parallel import distributed

    register_schema()
    runs = _documented_runs(project)
    # docs/storage.md's bucket, on the tests' S3 server: the finished run's checkpoint in it
    bucket = contextlib.ExitStack()
    s3 = bucket.enter_context(servers.s3(tmp_path / "moto.log", buckets=("my-bucket",)))
    _put_checkpoint(s3, project / "outputs" / "runs" / "DATE" / "TIME", "my-bucket", "exp1")
    servers.use_s3(monkeypatch, s3)
    monkeypatch.chdir(project)
    monkeypatch.setenv("HOME", str(project / "home"))
    monkeypatch.syspath_prepend(str(project / "home" / "lab"))
    # what resolving sets in this process's environment (torch's inductor, its cache's place) is
    # not the next test's: put back as it was
    environ = dict(os.environ)
    failures: list[str] = []
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
            for index, (where, script, overrides, gpus) in enumerate(runs):
                with monkeypatch.context() as scoped:
                    if gpus:
                        scoped.setenv(distributed.CHECK_GPUS_ENV, gpus)
                    try:
                        name = "config" if script == "train.py" else "eval"
                        composed = compose(name, overrides, return_hydra_config=True)
                        # ${hydra:...} as a run reads it (the MLflow logger's store: its cwd)
                        HydraConfig.instance().set_config(composed)
                        with open_dict(composed):
                            del composed["hydra"]
                        run_dir = tmp_path / f"run{index}"
                        if script == "train.py":
                            resolve.resolve(composed, run_dir, None, checked=False)
                        else:
                            given = [o for o in overrides if not o.startswith("ckpt=")]
                            resolve.eval_config(composed, given, run_dir, None)
                    except Exception as error:  # noqa: BLE001  (each command's own line)
                        line = str(error).strip().splitlines()[0] if str(error).strip() else ""
                        failures.append(f"{where}\n    → {type(error).__name__}: {line}")
    finally:
        GlobalHydra.instance().clear()
        os.environ.clear()
        os.environ.update(environ)
        bucket.close()
    assert not failures, f"{len(failures)} documented command(s) do not compose and resolve:\n" + (
        "\n".join(failures)
    )
    assert len(runs) > 60


def _put_checkpoint(s3: dict[str, str], run: Path, bucket: str, prefix: str) -> None:
    """`run`'s last checkpoint in the bucket as a run with checkpoint.dir=s3://BUCKET/PREFIX leaves
    it: the object, and `last` naming it (docs/storage.md)."""
    client = servers.s3_client(s3)
    name = "step-00000008.pt"  # the run's last step (support.QUICK)
    data = (run / "checkpoints" / "last.pt").read_bytes()
    client.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=data)
    client.put_object(Bucket=bucket, Key=f"{prefix}/last", Body=f"{name}\n".encode())
