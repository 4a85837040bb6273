"""Performance options: each changes how a step runs, not what it computes (or within tolerance)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support import (
    REPO,
    assert_no_orphans,
    assert_same_run,
    check_ok,
    final_params,
    finish,
    losses,
    run_train,
    start_train,
    summary,
    train_env,
)

STEPS = ("trainer.max_steps=6", "trainer.log_every=2")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    check_ok(run_train(run_dir, *STEPS))
    return run_dir


@pytest.mark.parametrize(
    "overrides, exact",
    [
        (("data.preload=true",), True),  # the same batches, sliced from tensors
        (
            (
                "data.num_workers=1",
                "data.persistent_workers=true",
                "data.prefetch_factor=2",
                "data.pin_memory=true",
            ),
            True,
        ),  # the same batches, made in a worker process (pinning is for GPUs: ignored on the CPU)
        (("trainer.compile=true", "trainer.compile_backend=eager"), True),
        # gloo's all-reduce instead of the shared segment: at 2 ranks the same sums.
        (("strategy.shared_memory=false",), True),
        # Each of DDP's two settings `auto` turns on, alone off (docs/auto.md: bit-identical):
        # gradients copied into and out of the buckets, and buckets rebuilt from the first step's
        # order.
        (("strategy.gradient_as_bucket_view=false",), True),
        (("strategy.static_graph=false",), True),
        # Smaller buckets (other all-reduce groupings), and the fast settings `auto` turns on
        # (performance.py) turned off: within tolerance.
        (
            (
                "strategy.bucket_cap_mb=1",
                "trainer.channels_last=false",
                "strategy.gradient_as_bucket_view=false",
                "strategy.static_graph=false",
                "strategy.shared_memory=false",
            ),
            False,
        ),
    ],
    ids=[
        "preload",
        "loader-workers",
        "compile",
        "gloo-all-reduce",
        "gradient-as-bucket-view-off",
        "static-graph-off",
        "ddp-buckets-and-auto-settings-off",
    ],
)
def test_option_trains_the_same(
    reference: Path, run_dir: Path, overrides: tuple[str, ...], exact: bool
):
    proc = start_train(run_dir, *STEPS, *overrides)
    proc.wait(timeout=150)
    # Nothing outlives the run (loader workers end with their ranks), not even holding its output.
    try:
        assert_no_orphans(proc.pid, grace_s=3)
    finally:
        with contextlib.suppress(ProcessLookupError):  # nothing left in its group: as it should
            os.killpg(proc.pid, signal.SIGKILL)
    check_ok(finish(proc, timeout=10))
    settings = summary(run_dir)["settings"]  # the run used the settings asked for
    for key, value in (
        override.split("=", 1) for override in overrides if override.split("=")[0] in settings
    ):
        assert settings[key] == (value == "true"), (key, settings)
    if exact:  # bit for bit: every step's loss, and the final weights
        assert_same_run(run_dir, reference)
    else:
        assert losses(run_dir) == pytest.approx(losses(reference), rel=1e-4)


@pytest.mark.timeout(300)
def test_compile_with_inductor_the_default_backend_builds_kernels_and_trains_the_same(
    reference: Path, tmp_path: Path
):
    # The backend a user gets: inductor generates and builds C++ kernels (g++), which the cache
    # shows; a failed compile would fall back to eager with a warning and build none.
    cache = tmp_path / "inductor"
    check_ok(
        run_train(
            tmp_path / "run",
            *STEPS,
            "trainer.compile=true",
            env={"TORCHINDUCTOR_CACHE_DIR": str(cache)},
            timeout=240,
        )
    )
    assert list(cache.rglob("*.so")), sorted(p.name for p in cache.rglob("*"))[:20]
    # Fused kernels sum in another order: over six steps, within the suite's early-step bound of
    # 1e-6.
    assert losses(tmp_path / "run") == pytest.approx(losses(reference), rel=1e-6)


def test_auto_settings_are_chosen_per_model_and_named_in_the_summary(
    reference: Path, run_dir: Path
):
    on = {
        "trainer.channels_last": True,
        "strategy.gradient_as_bucket_view": True,
        "strategy.static_graph": True,
        "strategy.shared_memory": True,
    }
    # the CNN: convolutions, even shards, no compile, one host
    assert summary(reference)["settings"] == on
    # No convolutions: no channels_last; uneven shards (Join): no static graph and no shared memory.
    check_ok(run_train(run_dir, *STEPS, "model=mlp", "data.even_shards=false"))
    assert summary(run_dir)["settings"] == {
        **on,
        "trainer.channels_last": False,
        "strategy.static_graph": False,
        "strategy.shared_memory": False,
    }


def test_gradient_accumulation_equals_one_larger_batch(reference: Path, tmp_path: Path):
    big, small = reference, tmp_path / "accumulated"  # the reference: batches of 32 per rank
    assert summary(big)["batch_size"] == 32
    check_ok(run_train(small, *STEPS, "data.batch_size=16", "trainer.accumulate=2"))
    a, b = final_params(big), final_params(small)
    for key in a:
        assert torch.allclose(a[key], b[key], atol=1e-5), key
    assert losses(small) == pytest.approx(losses(big), rel=1e-5)


def test_an_epochs_short_last_accumulation_group_is_the_mean_of_its_own_batches(tmp_path: Path):
    # 80 samples a rank in batches of 8: 10 batches, in groups of 3, 3, 3 and 1. The same epoch in
    # batches of 24 (24, 24, 24 and 8 samples) is the same four steps computed directly: the last
    # step's gradient is its one batch's mean, not a third of it.
    common = (
        "data=synthetic",
        "data.dataset.train_size=160",
        "data.dataset.test_size=16",
        "data.val_fraction=0",
        "trainer.epochs=1",
        "trainer.log_every=2",
        "trainer.channels_last=false",
    )
    accumulated, direct = tmp_path / "accumulated", tmp_path / "direct"
    check_ok(run_train(accumulated, *common, "data.batch_size=8", "trainer.accumulate=3"))
    check_ok(run_train(direct, *common, "data.batch_size=24"))
    assert summary(accumulated)["steps"] == summary(direct)["steps"] == 4
    a, b = final_params(accumulated), final_params(direct)
    for key in a:
        assert torch.allclose(a[key], b[key], rtol=0, atol=1e-6), (
            key,
            (a[key] - b[key]).abs().max().item(),
        )


def test_tune_loader_prints_the_best_setting():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hydra_ddp.tools.tune_loader",
            "tune.num_workers=[0,1]",
            "tune.batches=5",
        ],
        cwd=REPO,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "samples/s" in proc.stdout and "best: data.num_workers=" in proc.stdout


def test_tune_times_real_steps_and_prints_the_fastest_overrides():
    # Configured with every core for each of the two ranks (oversubscribed: 0.4× on 2 cores in
    # bench/results), the tuner's real runs find fewer threads per rank faster, by far more than its
    # 5 % noise margin.
    cores = len(os.sched_getaffinity(0))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hydra_ddp.tools.tune",
            f"trainer.threads={cores}",
            "tune.knobs=[trainer.threads]",
            "tune.steps=12",
            "tune.repeats=1",
        ],
        cwd=REPO,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stderr
    timed = [
        line.split(":")[0].strip()
        for line in proc.stdout.splitlines()
        if line.endswith("samples/s")
    ]
    # half, all and twice cores ÷ ranks
    values = sorted({max(1, cores // 4), max(1, cores // 2), cores})
    assert timed == [f"trainer.threads={n}" for n in values], proc.stdout
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("fastest: trainer.threads=") and not last.startswith(
        f"fastest: trainer.threads={cores} "
    ), last
    speedup = float(last.split("(", 1)[1].split("×", 1)[0])
    assert speedup > 1.05, last  # timed again side by side, after the search
    assert f"{len(values) + 2} runs" in last  # each value, then configured and tuned once each


TUNER_RUN = """
import json, sys, time
from pathlib import Path
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra_ddp.config.schema import register_schema
from hydra_ddp.launch import workers
from hydra_ddp.tools import tune

if __name__ == "__main__":
    register_schema()
    ConfigStore.instance().store(name="schema", node=tune.SettingsTuneConfig)
    with initialize_config_dir(config_dir=str(tune.CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=["data.num_workers=1"])
    run_dir = Path(sys.argv[1])
    resolved = tune.Timer(cfg, 3, run_dir).resolved({}, run_dir)
    summary = workers.launch(resolved, run_dir, time.time())
    print(json.dumps({k: summary[k] for k in ("steps", "history", "test_passes", "tested")}))
"""


def test_a_tuner_run_times_its_steps_and_evaluates_nothing(tmp_path: Path):
    # One candidate of the tuner, as it launches them: its steps and its summary, no validation at
    # its end and no test (time the measurement does not need, and loader workers forked for them).
    script = tmp_path / "tuner_run.py"
    script.write_text(TUNER_RUN)
    (tmp_path / "run").mkdir()
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "run")],
        cwd=REPO,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary == {"steps": 3, "history": [], "test_passes": 0, "tested": None}


def test_tune_refuses_an_unknown_knob_in_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "hydra_ddp.tools.tune", "tune.knobs=[trainer.speed]"],
        cwd=REPO,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2  # a usage error, as train.py's
    assert proc.stderr.strip().splitlines() == [
        "hydra-ddp: error: tune.knobs: unknown trainer.speed; the knobs are "
        + ", ".join(
            [
                "data.num_workers",
                "data.pin_memory",
                "trainer.threads",
                "trainer.channels_last",
                "strategy.bucket_cap_mb",
                "strategy.shared_memory",
                "trainer.precision",
                "strategy.comm_hook",
            ]
        )
    ], proc.stderr
