"""Debug and experiment presets, profiler traces and a clean terminal, on real 2-rank gloo runs."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
from pathlib import Path

from support import REPO, check_ok, documented, run_train, summary, train_env, write_cifar


def test_overfit_preset_drives_its_fixed_batches_to_zero_loss(run_dir: Path):
    check_ok(run_train(run_dir, *documented("docs/workflow.md", "debug=overfit")))
    s = summary(run_dir)
    assert s["train_loss"] < 0.01 and s["val_accuracy"] == 1.0 and s["val_samples"] == 2 * 32 * 2


def test_profile_preset_under_torchrun_leaves_a_trace_per_rank_and_a_top_ops_table(run_dir: Path):
    proc = run_train(run_dir, *documented("docs/workflow.md", "debug=profile"), "launcher=torchrun")
    check_ok(proc)
    for rank in (0, 1):
        trace = json.loads((run_dir / "profile" / f"rank{rank}.json").read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert "ProfilerStep#3" in names and any(str(n).startswith("aten::") for n in names)
    log = (run_dir / "train.log").read_text()
    assert log.count("Self CPU %") == 2 and "profile of rank 1 (steps 3…5)" in log
    assert summary(run_dir)["steps"] == 8  # the preset's few steps, trained as without it


def test_cifar10_resnet18_experiment_trains_on_files_in_cifar10_format(tmp_path: Path):
    write_cifar(tmp_path / "cifar")
    run_dir = tmp_path / "run"
    proc = run_train(
        run_dir,
        *documented("docs/workflow.md", "+experiment=cifar10_resnet18"),  # its /data/cifar: ours
        f"data.dataset.root={tmp_path / 'cifar'}",
        "trainer.max_steps=2",
        "data.num_workers=0",
    )
    check_ok(proc)
    s = summary(run_dir)
    assert s["steps"] == 2 and s["global_batch_size"] == 128 and s["test_samples"] == 20
    config = (run_dir / ".hydra" / "config.yaml").read_text()
    assert (
        "small_input: true" in config
        and "nesterov: true" in config
        and "CosineAnnealingLR" in config
    )


def _screen(raw: str) -> list[str]:
    """The lines a terminal shows for `raw`: carriage returns overwrite, escape codes dropped."""
    raw = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", raw)
    lines = []
    for line in raw.replace("\r\n", "\n").split("\n"):
        shown: list[str] = []
        for segment in line.split("\r"):
            shown[: len(segment)] = segment  # written from column 0 over what was there
        lines.append("".join(shown).rstrip())
    return lines


def test_log_lines_and_the_progress_bar_never_share_a_line_in_a_terminal(run_dir: Path):
    main, secondary = pty.openpty()
    # a 120-column terminal
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    os.set_blocking(main, False)
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), "trainer.epochs=3", f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        env=train_env(),
        stdin=secondary,
        stdout=secondary,
        stderr=secondary,
        start_new_session=True,
    )
    os.close(secondary)
    chunks = []
    while True:
        ready, _, _ = select.select([main], [], [], 150)
        if not ready:
            proc.kill()
            raise AssertionError("train.py in a terminal went silent for 150 s")
        try:
            data = os.read(main, 65536)
        except OSError:  # the terminal closed: every process that held it has exited
            break
        if not data:
            break
        chunks.append(data)
    os.close(main)
    assert proc.wait(timeout=30) == 0
    lines = _screen(b"".join(chunks).decode(errors="replace"))
    records = [line for line in lines if re.search(r"\[\d{4}-\d\d-\d\d ", line)]
    assert any("epoch 3/3" in line for line in records) and any(
        "63/63" in line and "%|" in line for line in lines
    )
    for line in records:  # a record starts its own line and nothing of the bar is left before it
        assert line.startswith("[20"), line
        assert "%|" not in line and "step/s" not in line, line
    assert not any(line.startswith("][") for line in lines)
    assert not any("checkpoint: step" in line for line in lines)  # in the log file only


def test_anomaly_preset_names_the_operation_that_made_a_nan(run_dir: Path):
    proc = run_train(run_dir, "debug=anomaly", "optim.lr=1e30", "trainer.max_steps=20")
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "returned nan values" in lines[0], proc.stderr
