"""The `hydra-ddp` command, also `python -m hydra_ddp`: train.py's and eval.py's jobs, and the
tools, for an installed package run from any directory.

    hydra-ddp train [overrides]          # as python train.py [overrides]
    hydra-ddp eval ckpt=RUN_DIR          # as python eval.py ckpt=RUN_DIR
    hydra-ddp export ckpt=RUN_DIR out=model.safetensors

The config groups come from the package (pkg://hydra_ddp.conf: the repository's conf/, shipped in
the wheel). train.py and eval.py run the same jobs (`run_job`) from the repository's conf/.

Importing this module imports neither torch nor Hydra: a command's workers start importing torch
(startup.preload) before the parent composes its config.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, NoReturn, Optional

from hydra_ddp import project
from hydra_ddp.errors import UserError
from hydra_ddp.launch import continuing, startup
from hydra_ddp.runtime import ranks

PACKAGE_CONF = "pkg://hydra_ddp.conf"
WARM = "HYDRA_DDP_WARM"  # a warm process's socket (hydra_ddp.warm): commands start in its forks
CONFIG_OF_JOB = {"train": "config", "eval": "eval"}  # a Hydra job, and its primary config's name
# The commands, each with its usage line: the help, and the one line for a command it does not know.
COMMANDS = {
    "train": ("train [overrides]", "compose, check and launch a training run (as python train.py)"),
    "eval": ("eval ckpt=PATH", "evaluate a saved checkpoint (as python eval.py)"),
    "export": (
        "export ckpt=PATH",
        "write a checkpoint's weights for inference (python -m hydra_ddp.export)",
    ),
    "generate": (
        "generate ckpt=PATH prompt=TEXT",
        "sample from a trained language model (python -m hydra_ddp.generate)",
    ),
    "init": (
        "init DIR",
        "start a project of your own in DIR: a task, a model, data, their configs",
    ),
    "warm": (
        "warm start|stop|status",
        "keep torch imported in the background: commands start in a fork of it",
    ),
}
USAGE = "\n".join(
    [
        "usage: hydra-ddp COMMAND [ARGS]",
        "",
        *(f"  {form:<22}{what}" for form, what in COMMANDS.values()),
        "",
        "Overrides are Hydra's: key=value, group=option, "
        "-m for a sweep; train --check launches nothing.",
    ]
)


def run_job(
    job: str, config_path: str, started_at: float, argv: Optional[list[str]] = None
) -> NoReturn:
    """train.py's or eval.py's command: take --check, start the workers' imports, compose the config
    (`config_path`: where its groups are), run the job, and end the process without the
    interpreter's teardown (command.exit_after)."""
    if argv is not None:
        sys.argv = argv  # Hydra reads its overrides there
    if os.environ.get(WARM) and not startup.warm_fork and not ranks.external_launch():
        from hydra_ddp.warm import command as warm

        # the command runs in a fork of the warm process; this process waits for it
        warm.run_in_fork(job, config_path, started_at, sys.argv)
    if job == "train":  # a run continued in its directory: its own record, this command's on top
        continuing.adopt(sys.argv)
    check_only = startup.take_check_flags(sys.argv)  # --check: compose and check, launch nothing
    if not check_only and not ranks.external_launch():
        # The workers' imports (torch, the project) start now, in a forkserver, beside the parent's
        # own.
        startup.preload(sys.argv)
    with startup.frozen_imports():  # half a million objects that live as long as the process
        import hydra

        from hydra_ddp.config.schema import register_schema
        from hydra_ddp.launch import command
    register_schema()
    task = _train(started_at, check_only) if job == "train" else _eval(started_at)
    main = hydra.main(version_base=None, config_path=config_path, config_name=CONFIG_OF_JOB[job])(
        task
    )
    if ranks.launches_workers(os.environ):  # a Kubernetes pod's train.py: the pod's settings
        from hydra_ddp.clusters import kubernetes
        from hydra_ddp.errors import say

        try:
            kubernetes.adopt(sys.argv)
        except UserError as error:  # before Hydra: nothing composed, nothing launched
            say(f"hydra-ddp: error: {error}")
            code = error.exit_code
            command.exit_after(lambda: sys.exit(code))  # without torch's seconds of teardown
    command.adopt_external_launch(sys.argv)
    command.exit_after(main)


def as_worker_main(module: str) -> None:
    """What train.py and eval.py do when a worker imports them as its main module (__mp_main__):
    the YAML resolvers, and the imports every worker makes anyway, frozen."""
    with startup.frozen_imports():
        from hydra_ddp.config.schema import register_schema
    register_schema(module)


def _train(started_at: float, check_only: bool) -> Any:
    from omegaconf import DictConfig

    from hydra_ddp import tasks
    from hydra_ddp.errors import UserError
    from hydra_ddp.launch import command

    start = [started_at]

    def train(cfg: DictConfig) -> Optional[float]:
        """Returns what a Hydra sweeper (e.g. Optuna) optimises: the best value of trainer.monitor
        (a validation metric: never the test set's)."""
        # a multirun's later jobs in this process: now
        begun = start.pop() if start else time.time()
        try:
            summary = command.run(cfg, begun)
        except UserError as error:
            command.fail(error)  # one line, no traceback; in a multirun the next job still runs
            # A failed or diverged trial ranks last instead of ending the sweep: a value every
            # finished run beats, settled from the composed config (there is no resolved one).
            return tasks.worst_for(cfg)
        if check_only:
            # a sweeper asks each checked trial for a number
            worst = tasks.worst_for(cfg)
            return worst if worst is not None else 0.0
        if not summary:
            return None  # not node 0
        return summary["objective"] if summary["objective"] is not None else tasks.worst_for(cfg)

    return train


def _eval(started_at: float) -> Any:
    from omegaconf import DictConfig

    from hydra_ddp.errors import UserError
    from hydra_ddp.launch import command

    def evaluate(cfg: DictConfig) -> Optional[float]:
        """Returns the task's first metric on the split (its loss, for the built-in tasks)."""
        try:
            result = command.run(cfg, started_at, job="eval")
        except UserError as error:
            command.fail(error)
            return None
        return result[f"{cfg.split}_{result['metrics'][0]}"] if result else None

    return evaluate


def main(argv: Optional[list[str]] = None) -> int:
    """`hydra-ddp COMMAND ...`: one line and exit status 2 for a command it does not know."""
    started_at = time.time()
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        *others, last = COMMANDS
        choose = f"choose {', '.join(others)} or {last} (hydra-ddp --help)"
        print(f"hydra-ddp: error: no command {name!r}; {choose}", file=sys.stderr)
        return 2
    try:
        if name == "init":
            return _init(rest)
        if name == "warm":
            return _warm(rest)
        # the project run from: its conf/ ahead of the package's, its package importable
        found = project.find()
    except UserError as error:
        print(f"hydra-ddp: error: {error}", file=sys.stderr)
        return error.exit_code
    project.importable(found)
    if name == "export":
        from hydra_ddp import export

        return export.main(rest)
    if name == "generate":
        from hydra_ddp import generate

        return generate.main(rest)
    conf = project.extra_conf(found)
    for line in project.shadowed(conf, project.package_conf()) if conf else []:
        print(line, file=sys.stderr)
    run_job(name, PACKAGE_CONF, started_at, [f"hydra-ddp {name}", *rest])


def _init(args: list[str]) -> int:
    from hydra_ddp import init

    if len(args) != 1:
        raise UserError(
            "hydra-ddp init takes one argument, the new project's directory: hydra-ddp init DIR"
        )
    folder, written = init.init(args[0])
    print(
        f"hydra-ddp: wrote {len(written)} files to {folder}; then: "
        f"cd {args[0]} && hydra-ddp train +experiment=spirals"
    )
    return 0


def _warm(args: list[str]) -> int:
    """`hydra-ddp warm start` prints the line that points this shell's commands at it, for
    eval "$(hydra-ddp warm start)"; `serve` is the warm process itself, which `start` runs."""
    import shlex

    from hydra_ddp.warm import command as warm

    if len(args) != 1 or args[0] not in ("start", "stop", "status", "serve"):
        raise UserError("hydra-ddp warm takes one of start, stop or status: hydra-ddp warm start")
    path = os.environ.get(WARM) or warm.default_path()
    if args[0] == "serve":
        from hydra_ddp.warm import server

        server.main(path, run_job)
        return 0
    if args[0] == "start":
        answer = warm.start(path)
        print(f"export {WARM}={shlex.quote(path)}")
        print(
            f"hydra-ddp: warm process {answer['pid']} at {path}; commands with {WARM} set "
            "start in a fork of it",
            file=sys.stderr,
        )
        return 0
    answer = warm.ask(path) if args[0] == "status" else None
    if args[0] == "stop" and warm.stop(path):
        print(f"hydra-ddp: stopped the warm process at {path}", file=sys.stderr)
        return 0
    if answer is None:
        print(f"hydra-ddp: no warm process answers at {path}", file=sys.stderr)
        return 1
    print(
        f"hydra-ddp: warm process {answer['pid']} at {path}: {answer['served']} command(s) "
        f"served, {answer['running']} running, up {time.time() - answer['since']:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
