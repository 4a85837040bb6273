"""A bucket's checkpoint folder (src/hydra_ddp/checkpoint/remote.py), on fsspec's in-memory
filesystem: which checkpoints are complete, the pointers, pruning, the lock's conditional write,
retries with backoff, and the one line for a store that cannot be used. The S3 server's tests are
tests/e2e/test_storage.py."""

from __future__ import annotations

import importlib.util
import uuid

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from hydra_ddp.checkpoint import files, remote
from hydra_ddp.checkpoint.remote import Bucket, Remote
from hydra_ddp.errors import UserError


def fresh() -> Bucket:
    return Bucket(f"memory://bucket/{uuid.uuid4().hex}")


def test_only_whole_checkpoints_count_oldest_first_and_a_prefix_without_its_index_is_torn():
    bucket = fresh()
    bucket.put("step-00000012.pt", b"file")
    bucket.put("step-00000003.pt", b"file")
    bucket.put("step-00000006/__0_0.distcp", b"shard")
    bucket.put("step-00000006/.metadata", b"index")
    bucket.put("step-00000009/__0_0.distcp", b"shard")  # its upload killed before the index
    bucket.put("notes.txt", b"not a checkpoint")
    steps = bucket.steps()
    assert [s.name for s in steps] == ["step-00000003.pt", "step-00000006", "step-00000012.pt"]
    assert [s.is_dir() for s in steps] == [False, True, False]
    assert steps[1] == f"{bucket.url}/step-00000006"
    assert bucket.incomplete() == ["step-00000009"]


def test_pointers_name_a_complete_checkpoint_and_pruning_keeps_the_newest_and_the_best():
    bucket = fresh()
    for step in (3, 6, 9, 12):
        bucket.put(f"step-{step:08d}.pt", b"file")
    best = Remote(bucket.at("step-00000003.pt"), sharded=False)
    bucket.point("best", best)
    bucket.point("last", Remote(bucket.at("step-00000012.pt"), sharded=False))
    bucket.prune(keep=2)
    assert [s.name for s in bucket.steps()] == [
        "step-00000003.pt",
        "step-00000009.pt",
        "step-00000012.pt",
    ]
    assert bucket.pointed("best") == best
    assert bucket.pointed("last").name == "step-00000012.pt"
    bucket.remove("step-00000012.pt")
    assert bucket.pointed("last") is None  # a pointer to what is gone names nothing


def test_the_lock_is_written_only_where_none_is():
    bucket = fresh()
    assert bucket.create(remote.LOCK, b"first")
    assert not bucket.create(remote.LOCK, b"second")
    assert bucket.read_text(remote.LOCK) == "first"


class Flaky(MemoryFileSystem):
    """The in-memory filesystem, failing its first `failures` writes as a dropped connection."""

    protocol = "flaky"
    failures = 0

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        if Flaky.failures:
            Flaky.failures -= 1
            raise ConnectionResetError("connection reset by peer")
        return super().pipe_file(path, value, mode=mode, **kwargs)


@pytest.fixture
def flaky(monkeypatch: pytest.MonkeyPatch):
    fsspec.register_implementation("flaky", Flaky, clobber=True)
    monkeypatch.setattr(remote, "BACKOFF_S", 0.0)  # the same tries, without the waits between
    return Bucket(f"flaky://bucket/{uuid.uuid4().hex}")


def test_a_transient_failure_is_tried_again_and_one_that_persists_names_the_url(flaky):
    Flaky.failures = remote.TRIES - 1
    flaky.put("step-00000001.pt", b"data")
    assert flaky.get("step-00000001.pt") == b"data"
    Flaky.failures = remote.TRIES
    with pytest.raises(OSError) as failed:
        flaky.put("step-00000002.pt", b"data")
    assert str(failed.value).startswith(f"writing {flaky.url}/step-00000002.pt: ")
    assert f"tried {remote.TRIES} times" in str(failed.value)
    Flaky.failures = 0


def test_a_missing_object_is_not_tried_again():
    bucket = fresh()
    with pytest.raises(FileNotFoundError):
        bucket.get("step-00000001.pt")


def test_what_names_object_storage_and_what_names_a_local_folder(tmp_path):
    assert remote.is_url("s3://bucket/run") and remote.is_url("gs://b/x")
    assert not remote.is_url("outputs/run") and not remote.is_url(f"file://{tmp_path}")
    assert remote.local_path(f"file://{tmp_path}/c") == tmp_path / "c"
    assert files.folder(f"file://{tmp_path}/c", tmp_path / "run") == tmp_path / "c"
    assert files.folder(None, tmp_path / "run") == tmp_path / "run" / "checkpoints"
    assert isinstance(files.folder("memory://b/x", tmp_path), Bucket)


@pytest.mark.skipif(importlib.util.find_spec("gcsfs") is not None, reason="gcsfs is installed")
def test_a_store_whose_package_is_missing_is_one_line_that_says_how_to_install_it():
    problem = remote.reachable("gs://bucket/run", "checkpoint.dir")
    assert problem == "checkpoint.dir=gs://bucket/run needs gcsfs: pip install 'hydra-ddp[gcs]'"


def test_a_checkpoint_folder_in_a_bucket_is_found_by_its_best_else_its_last():
    bucket = fresh()
    with pytest.raises(UserError, match="no checkpoint there"):
        files.find(bucket.url, "ckpt")
    bucket.put("step-00000004/.metadata", b"index")
    bucket.point("last", bucket.steps()[-1])
    assert files.find(bucket.url, "ckpt").name == "step-00000004"
    bucket.put("step-00000002.pt", b"file")
    bucket.point("best", bucket.steps()[0])
    found = files.find(bucket.url, "ckpt")
    assert found.name == "step-00000002.pt" and not found.is_dir()
