"""Checkpoints in object storage (checkpoint.dir=s3://…, docs/storage.md), against a real S3
endpoint: moto's server on loopback, spoken to over HTTP by the same client (s3fs, botocore) that a
user's S3 gets, with its endpoint and credentials in the standard AWS variables."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from pathlib import Path

import pytest

import servers
from support import (
    ONCE,
    check_ok,
    documented,
    final_params,
    finish,
    run_eval,
    run_export,
    run_train,
    start_train,
    step_losses,
    wait_for,
)

# 12 steps of 2 ranks, a checkpoint every 3; the first command is killed while it uploads the third
# (step 9): the one before (step 6) is complete.
COMMON = (
    "trainer.nproc=2",
    "trainer.max_steps=12",
    "trainer.log_every=1",
    "checkpoint.every_n_steps=3",
)
KILLED_AT, RESUMED_AT = 9, 6


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """The S3 server, its bucket `runs`, and the variables a client reads."""
    log = tmp_path_factory.mktemp("s3") / "moto.log"
    with servers.s3(log, buckets=("runs", "gone", "my-bucket")) as env:
        yield env


def bucket_keys(env: dict[str, str], prefix: str) -> list[str]:
    client = servers.s3_client(env)
    listed = client.list_objects_v2(Bucket="runs", Prefix=prefix)
    return sorted(item["Key"] for item in listed.get("Contents", []))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_run_killed_mid_upload_resumes_from_the_bucket_alone_as_the_uninterrupted_run(
    tmp_path: Path, s3: dict[str, str], strategy: str, monkeypatch: pytest.MonkeyPatch
):
    """The first command is SIGKILLed (every process, as a lost node) halfway through uploading its
    step-9 checkpoint; a second command in a new run directory, given only the bucket, continues
    from step 6 and trains bit for bit as the run that was never interrupted (every step's loss
    after the resume, and the final weights); eval.py takes the bucket's checkpoint. No credential
    is in any file of the runs or in the bucket."""
    common = (*COMMON, f"strategy={strategy}")
    url = f"s3://runs/{strategy}"
    reference = tmp_path / "reference"
    check_ok(run_train(reference, *common))  # checkpoints on local disk

    killed = tmp_path / "killed"
    # rank 1 (fsdp: its own shard) while rank 0's upload may be whole
    dies = ("model._target_=faulty.DiesUploading", "+model.n=3", ONCE)
    dies_rank = ("+model.rank=1",) if strategy == "fsdp" else ()
    proc = start_train(killed, *common, f"checkpoint.dir={url}", *dies, *dies_rank, env=s3)
    done = finish(proc, timeout=150)
    assert done.returncode == -signal.SIGKILL, done.stderr
    keys = bucket_keys(s3, f"{strategy}/")
    assert f"{strategy}/last" in keys, keys
    complete = "step-00000006.pt" if strategy == "ddp" else "step-00000006/.metadata"
    assert f"{strategy}/{complete}" in keys, keys
    assert not [k for k in keys if "step-00000009" in k and k.endswith((".pt", ".metadata"))]
    _assert_no_credentials(s3, [killed], strategy)
    shutil.rmtree(killed)  # the bucket alone

    resumed = tmp_path / "resumed"
    again = (*common, f"checkpoint.dir={url}", "trainer.resume=auto", *dies, *dies_rank)
    done = run_train(resumed, *again, env=s3)
    check_ok(done)
    assert f"resumed from {url}/step-0000000{RESUMED_AT}" in done.stderr + done.stdout
    after = [(step, loss) for step, loss in step_losses(reference) if step > RESUMED_AT]
    assert step_losses(resumed) == after
    last = run_eval(
        tmp_path / "eval-bucket",
        f"ckpt={url}/step-00000012" + (".pt" if strategy == "ddp" else ""),
        env=s3,
    )
    check_ok(last)
    local = run_eval(tmp_path / "eval-local", f"ckpt={reference}")
    check_ok(local)
    bucket_result = json.loads((tmp_path / "eval-bucket" / "eval.json").read_text())
    local_result = json.loads((tmp_path / "eval-local" / "eval.json").read_text())
    same = ("step", "test_loss", "test_accuracy", "test_samples")
    assert {k: bucket_result[k] for k in same} == {k: local_result[k] for k in same}
    assert bucket_result["step"] == 12
    # the final weights, read back from the bucket by the readers eval.py uses
    from hydra_ddp.checkpoint import files as checkpoints

    servers.use_s3(monkeypatch, s3)
    where = checkpoints.find(url, "test")
    weights = checkpoints.model_weights(where, checkpoints.read(where, "test"))
    expected = final_params(reference)
    assert weights.keys() == expected.keys()
    assert all(bool((weights[k] == expected[k]).all()) for k in weights)
    _assert_no_credentials(s3, [resumed, tmp_path / "eval-bucket"], strategy)


def _assert_no_credentials(env: dict[str, str], run_dirs: list[Path], prefix: str) -> None:
    secrets = [env["AWS_ACCESS_KEY_ID"].encode(), env["AWS_SECRET_ACCESS_KEY"].encode()]
    for run_dir in run_dirs:
        for file in run_dir.rglob("*"):
            if file.is_file():
                data = file.read_bytes()
                assert not [s for s in secrets if s in data], file
    client = servers.s3_client(env)
    for key in bucket_keys(env, f"{prefix}/"):
        data = client.get_object(Bucket="runs", Key=key)["Body"].read()
        assert not [s for s in secrets if s in data], key


def test_a_missing_bucket_and_missing_credentials_are_one_line_before_launch(
    tmp_path: Path, s3: dict[str, str]
):
    """Refused before any worker starts, with no run directory left behind."""
    run = tmp_path / "no-bucket"
    done = run_train(run, "checkpoint.dir=s3://no-such-bucket/run", env=s3)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "hydra-ddp: error: checkpoint.dir=s3://no-such-bucket/run: the bucket 'no-such-bucket' "
        "does not exist; create it, or name another"
    )
    assert not run.exists()
    run = tmp_path / "no-credentials"
    without = {**s3, "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""}
    done = run_train(run, "checkpoint.dir=s3://runs/no-credentials", env=without)
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "hydra-ddp: error: checkpoint.dir=s3://runs/no-credentials: no credentials for the store"
    ), last
    assert not run.exists()


def test_a_second_run_on_a_bucket_a_live_run_writes_to_is_refused(
    tmp_path: Path, s3: dict[str, str]
):
    """Two runs in different run directories, one checkpoint.dir: the second is refused while the
    first lives, as two runs in one run directory are."""
    url = "s3://runs/shared"
    first = start_train(tmp_path / "first", "trainer.epochs=1000", f"checkpoint.dir={url}", env=s3)
    try:
        wait_for(
            lambda: "shared/.hydra-ddp.lock" in bucket_keys(s3, "shared/"),
            timeout=60,
            what="the first run's lock in the bucket",
            proc=first,
        )
        second = run_train(  # its length the first's: the lock, not the length, refuses it
            tmp_path / "second",
            "trainer.epochs=1000",
            f"checkpoint.dir={url}",
            "trainer.resume=auto",
            env=s3,
        )
        assert second.returncode == 2, second.stderr
        last = second.stderr.strip().splitlines()[-1]
        assert last.startswith(
            f"hydra-ddp: error: checkpoint.dir={url} is in use by a live run (pid "
        ), last
    finally:
        os.killpg(first.pid, signal.SIGTERM)
        finish(first, timeout=60)
    assert "shared/.hydra-ddp.lock" not in bucket_keys(s3, "shared/")  # given up at its end


def test_a_store_that_keeps_refusing_writes_stops_the_run_in_one_line_naming_the_url(
    tmp_path: Path, s3: dict[str, str]
):
    url = "s3://gone/run"
    done = run_train(
        tmp_path / "run",
        *COMMON,
        f"checkpoint.dir={url}",
        "model._target_=faulty.DeletesBucket",
        "+model.bucket=gone",
        "+model.step=4",
        env=s3,
    )
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    # step 3's upload may still be under way when the bucket goes at step 4: then it is step 3's
    assert re.match(
        rf"hydra-ddp: error: could not write the checkpoint for step (3|6) in {url}: "
        rf"writing {url}/step-0000000\1\.pt: The specified bucket does not exist;",
        last,
    ), last
    assert "the previous checkpoint is intact" in last


def test_the_pages_commands_train_continue_elsewhere_and_evaluate_in_a_bucket(
    tmp_path: Path, s3: dict[str, str]
):
    """docs/storage.md's three commands, each in a run directory of its own: the second continues
    from the first's last checkpoint in the bucket, the third evaluates the bucket's best."""
    short = ("trainer.max_steps=6", "checkpoint.every_n_steps=3")
    first = run_train(
        tmp_path / "first",
        *documented(
            "docs/storage.md", "train.py trainer.nproc=2 checkpoint.dir=s3://my-bucket/exp1"
        ),
        *short,
        env=s3,
    )
    check_ok(first)
    more = run_train(
        tmp_path / "second",
        *documented("docs/storage.md", "trainer.resume=auto"),
        "trainer.max_steps=9",
        "checkpoint.every_n_steps=3",
        env=s3,
    )
    check_ok(more)
    assert "resumed from s3://my-bucket/exp1/step-00000006.pt" in more.stderr + more.stdout
    assert json.loads((tmp_path / "second" / "summary.json").read_text())["steps"] == 9
    evaluated = run_eval(tmp_path / "eval", *documented("docs/storage.md", "eval.py ckpt="), env=s3)
    check_ok(evaluated)
    result = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert result["checkpoint"].startswith("s3://my-bucket/exp1/step-")
    # the export reads the same checkpoint: its weights are the ones eval.py evaluated
    out = tmp_path / "export" / "model.safetensors"
    check_ok(run_export("ckpt=s3://my-bucket/exp1", f"out={out}", env=s3))
    from safetensors import safe_open

    with safe_open(str(out), "pt") as exported:
        assert exported.metadata()["checkpoint"] == result["checkpoint"]
