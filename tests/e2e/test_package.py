"""hydra-ddp as an installed package, as README's front door installs it: the repository's files
(a clone's) into a fresh virtual environment, pip resolving every dependency (no editable install,
no path borrowed from the suite's environment), once for the module; a wheel built from them
without a warning; then one `hydra-ddp init` project with its test extra, where the tests run:
its own test, `hydra-ddp train` at two ranks (spawn, torchrun, mpirun, submitit's local launcher,
Slurm's sbatch), `hydra-ddp eval` reproducing the run's test metrics, and a two-trial Optuna search
over the project's space."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support import REPO, free_port


def _run(
    args: list[str], cwd: Path, env: dict[str, str], timeout: float = 300
) -> subprocess.CompletedProcess:
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (
        f"{args}: exit {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    )
    return done


def _repository_copy(folder: Path) -> Path:
    """The repository's own files (tracked and new) in `folder`, without its build outputs: a
    clone's."""
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    for name in files:
        if (REPO / name).is_file():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, str]:
    """README's front door, once for the module: the package from a clone's folder into a venv of
    its own, pip resolving every dependency (torch from the machine's wheel cache, the rest from the
    registry or its cache), no path borrowed from the suite's environment. The environment of that
    venv, its bin first on PATH."""
    work = tmp_path_factory.mktemp("package")
    source = _repository_copy(work / "hydra-ddp")
    # (the session's warm process is another environment's: this one's commands start cold)
    unset = ("PYTHONPATH", "RANK", "WORLD_SIZE", "VIRTUAL_ENV", "HYDRA_DDP_WARM")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    # A build that warns looks broken to whoever installs it (issue 63: `make train` opened with
    # setuptools' warnings of the template's folders): the build says nothing it was not asked.
    built = _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-v",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(work / "wheels"),
            ".",
        ],
        source,
        env,
    )
    assert "Warning:" not in built.stdout + built.stderr, built.stdout + built.stderr
    # --no-compile beside README's command: pip byte-compiles every file it installs, torch's
    # thousands one at a time, which checks nothing of the package's (a file that does not compile
    # does not fail pip either); Python compiles what a run imports, once, in a shell that does not
    # forbid it. (PIP_NO_COMPILE=1 would not do: pip reads that variable inverted.)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    venv = work / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], work, env)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
    env["VIRTUAL_ENV"] = str(venv)
    _run(["pip", "install", "--quiet", "--no-compile", str(source)], work, env, timeout=600)
    # the clone is left as it was: setuptools' in-place build/ goes once the wheel is made
    assert not (source / "build").exists(), sorted(p.name for p in (source / "build").iterdir())
    return env


@pytest.fixture(scope="module")
def project(installed, tmp_path_factory) -> Path:
    """docs/project.md's project, once for the module: `hydra-ddp init`, then the project with its
    test extra (the tests below run in it, each writing outputs of its own)."""
    where = tmp_path_factory.mktemp("projects")
    done = _run(["hydra-ddp", "init", "my-lab"], where, installed)
    assert "wrote" in done.stdout and (where / "my-lab" / "my_lab" / "task.py").is_file()
    _run(["pip", "install", "--quiet", "-e", ".[test]"], where / "my-lab", installed, timeout=300)
    return where / "my-lab"


@pytest.mark.timeout(900)
def test_the_wheel_installs_with_its_dependencies_into_an_empty_venv_and_its_project_trains(
    installed, project: Path
):
    # As README's front door has it (the `installed` fixture): every dependency the package names
    # is there, the package and torch are the venv's own; then a project, its run and its own test.
    env = installed
    _run(["pip", "check"], project, env)
    where = _run(
        [
            "python",
            "-c",
            "import hydra_ddp, hydra_ddp.conf as c, torch; "
            "print(hydra_ddp.__file__, c.__file__, torch.__file__)",
        ],
        project,
        env,
    )
    assert all(path.startswith(env["VIRTUAL_ENV"]) for path in where.stdout.split()), where.stdout
    run_dir = project / "outputs" / "first"
    _run(
        [
            "hydra-ddp",
            "train",
            "+experiment=spirals",
            "trainer.max_steps=5",
            f"hydra.run.dir={run_dir}",
        ],
        project,
        env,
    )
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 5
    assert "outputs/" in (project / ".gitignore").read_text().split()
    # docs/project.md's last line: the project's own test, two steps at two ranks.
    _run(["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], project, env)


@pytest.mark.timeout(900)
def test_an_installed_wheel_starts_a_project_that_trains_evaluates_and_searches(
    installed, project: Path, tmp_path: Path
):
    env = installed
    # Two ranks, spawned and through torchrun: the same run, to the bit.
    runs = {}
    for launcher in ("spawn", "torchrun"):
        run_dir = project / "outputs" / launcher
        _run(
            [
                "hydra-ddp",
                "train",
                "+experiment=spirals",
                f"launcher={launcher}",
                "trainer.max_steps=150",
                "trainer.threads=1",
                f"hydra.run.dir={run_dir}",
            ],
            project,
            env,
        )
        runs[launcher] = json.loads((run_dir / "summary.json").read_text())
        assert (run_dir / "train.log").is_file() and runs[launcher]["world_size"] == 2
    metrics = ("test_loss", "test_accuracy")
    assert {k: runs["spawn"][k] for k in metrics} == {k: runs["torchrun"][k] for k in metrics}
    assert runs["spawn"]["test_accuracy"] > 0.5  # three classes: a third by chance

    # From outside: mpirun starting the command twice; submitit's local launcher running the job in
    # a process of its own (the Slurm launcher's path, without a cluster). The same run each time.
    outside = {
        "mpirun": (
            [
                "mpirun",
                "--allow-run-as-root",
                "--oversubscribe",
                "-np",
                "2",
                "-x",
                "PATH",
                "hydra-ddp",
                "train",
            ],
            [f"init_method.port={free_port()}"],
        ),
        "slurm_local": (["hydra-ddp", "train", "-m", "hydra/launcher=slurm_local"], []),
    }
    for name, (command, extra) in outside.items():
        if name == "mpirun" and shutil.which("mpirun") is None:
            pytest.skip("Open MPI is not installed (apt-get install openmpi-bin)")
        where = project / "outputs" / name
        place = f"hydra.run.dir={where}" if name == "mpirun" else f"hydra.sweep.dir={where}"
        _run(
            [
                *command,
                "+experiment=spirals",
                "trainer.max_steps=150",
                "trainer.threads=1",
                place,
                *extra,
            ],
            project,
            env,
        )
        done = json.loads(next(where.rglob("summary.json")).read_text())
        assert {k: done[k] for k in metrics} == {k: runs["spawn"][k] for k in metrics}, name

    # eval reproduces the run's test metrics, from the project's configs and package.
    _run(
        [
            "hydra-ddp",
            "eval",
            f"ckpt={project / 'outputs' / 'spawn'}",
            f"hydra.run.dir={tmp_path / 'eval'}",
        ],
        project,
        env,
    )
    result = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert {k: result[k] for k in metrics} == {k: runs["spawn"][k] for k in metrics}

    # The tools that read the config groups find the package's: the reference, the loader tuner.
    page = _run(["python", "-m", "hydra_ddp.tools.config_reference"], project, env).stdout
    assert "`trainer.epochs`" in page
    tuned = _run(
        [
            "python",
            "-m",
            "hydra_ddp.tools.tune_loader",
            "+experiment=spirals",
            "tune.batches=2",
            "tune.num_workers=[0]",
        ],
        project,
        env,
    )
    assert tuned.returncode == 0

    # The project's own search space, two trials.
    sweep = tmp_path / "search"
    _run(
        [
            "hydra-ddp",
            "train",
            "+experiment=spirals",
            "hparams_search=spirals",
            "hydra.sweeper.n_trials=2",
            "trainer.max_steps=10",
            f"hydra.sweep.dir={sweep}",
        ],
        project,
        env,
    )
    assert (
        len([p for p in sweep.iterdir() if p.name.isdigit()]) == 2
        and (sweep / "sweep.md").is_file()
    )


@pytest.mark.timeout(300)
def test_a_projects_sbatch_script_trains_on_the_suites_slurm_cluster(
    installed, project: Path, slurm_cluster, tmp_path: Path
):
    # The script `hydra-ddp init` writes (the clone's scripts/slurm/train.sbatch, which runs
    # `hydra-ddp train` where there is no train.py), submitted from the project to a real cluster.
    env = {**installed, **slurm_cluster.env}
    run_dir, output = project / "outputs" / "on-slurm", tmp_path / "slurm.out"
    overrides = [
        "+experiment=spirals",
        "trainer.max_steps=20",
        "trainer.threads=1",
        f"hydra.run.dir={run_dir}",
    ]
    submitted = subprocess.run(
        ["sbatch", "--wait", f"--output={output}", "scripts/train.sbatch", *overrides],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    log = output.read_text() if output.exists() else ""
    assert submitted.returncode == 0, f"{submitted.stdout}{submitted.stderr}\n{log}"
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["launcher"] == "srun" and s["world_size"] == 2 and s["steps"] == 20, s
