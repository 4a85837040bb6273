"""Shard directories (data/shards.py) and their training order (sampling.ShardWindowOrder): written
and read back, every sample once per epoch at any world size, resumable by position, and every
kind of damage one line."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from hydra_ddp import data
from hydra_ddp.config.schema import DataConf
from hydra_ddp.data import shards
from hydra_ddp.data.sampling import ShardWindowOrder, ShardWindowSampler
from hydra_ddp.errors import UserError
from hydra_ddp.runtime.ranks import RankInfo
from hydra_ddp.tools import shards as shard_tool


def _samples(n: int, offset: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.full((1, 2, 2), float(i + offset)), torch.tensor(i + offset)) for i in range(n)]


def _write(root: Path, train: int = 23, test: int = 5, per_shard: int = 4, **splits) -> Path:
    splits = {"train": _samples(train), "test": _samples(test, 1000), **splits}
    shards.write(root, splits, per_shard, {"in_channels": 1})
    return root


def test_samples_read_back_as_written_one_by_one_and_by_batch(tmp_path: Path):
    train, test = shards.sharded(str(_write(tmp_path)))
    assert (len(train), len(test), len(train.shards)) == (23, 5, 6)  # 5 shards of 4 and one of 3
    for i in (0, 3, 4, 22):
        x, y = train[i]
        assert (
            torch.equal(x, torch.full((1, 2, 2), float(i)))
            and y.item() == i
            and y.dtype == torch.int64
        )
    batch = train.__getitems__([22, 0, 5, 4, 21])
    assert [int(y) for _, y in batch] == [22, 0, 5, 4, 21]
    assert test[4][1].item() == 1004
    with pytest.raises(IndexError):
        train[23]


def test_dict_samples_keep_their_keys_and_dtypes(tmp_path: Path):
    rows = [
        {"input_ids": torch.arange(5) + i, "mask": torch.ones(5, dtype=torch.bool)}
        for i in range(6)
    ]
    shards.write(tmp_path, {"train": rows, "test": rows[:2]}, 4)
    train, _ = shards.sharded(str(tmp_path))
    assert list(train[5]) == ["input_ids", "mask"]
    assert (
        torch.equal(train[5]["input_ids"], torch.arange(5) + 5)
        and train[5]["mask"].dtype == torch.bool
    )


def test_a_field_of_different_lengths_is_stored_whole_and_padded_per_batch(tmp_path: Path):
    # A document's token ids, of any length: stored as values and offsets (a ragged field), read
    # back as written, and batched by the padding of data=documents where the manifest gives its id.
    lengths = [5, 1, 9, 3, 7]
    samples = [
        {"input_ids": torch.arange(n, dtype=torch.int32) + 10 * i, "kind": torch.tensor(i)}
        for i, n in enumerate(lengths)
    ]
    shards.write(
        tmp_path, {"train": samples[:4], "test": samples[4:]}, 3, {"pad_id": 1, "vocab_size": 64}
    )
    train, test = shards.sharded(str(tmp_path))
    read = [train[i] for i in range(4)] + [test[0]]
    assert [s["input_ids"].tolist() for s in read] == [s["input_ids"].tolist() for s in samples]
    assert [s["kind"].item() for s in read] == list(range(5)) and read[0][
        "input_ids"
    ].dtype == torch.int32
    # a batch, shard by shard
    assert [len(s["input_ids"]) for s in train.__getitems__([3, 0, 2])] == [3, 5, 9]
    batch = train.collate([train[0], train[1]])
    assert batch["input_ids"].tolist() == [[0, 1, 2, 3, 4], [10, 1, 1, 1, 1]]
    assert batch["labels"].tolist() == [[0, 1, 2, 3, 4], [10, -100, -100, -100, -100]]
    # a field of one shape: batched as DataLoader batches it
    assert batch["kind"].tolist() == [0, 1]
    assert shard_tool.verify(tmp_path) == []
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["version"] = 1  # a directory written before ragged fields: read as before
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert shards.read_manifest(tmp_path)["version"] == 1


def test_a_val_split_is_used_where_written_and_carved_as_whole_shards_otherwise(tmp_path: Path):
    assert len(shards.sharded(str(_write(tmp_path / "a", val=_samples(6, 500))))) == 3
    train, _ = shards.sharded(str(_write(tmp_path / "b", train=40, per_shard=4)))  # 10 shards
    rest, val = data.carve(train, 0.2, seed=3)
    assert (len(rest.shards), len(val.shards), len(rest) + len(val)) == (8, 2, 40)
    assert isinstance(val, shards.ShardedDataset)
    seen = sorted(int(rest[i][1]) for i in range(len(rest))) + sorted(
        int(val[i][1]) for i in range(len(val))
    )
    assert sorted(seen) == list(range(40))
    with pytest.raises(UserError, match="leaving none"):
        data.carve(train.subset([0]), 0.5, seed=0)


@pytest.mark.parametrize("sizes", [[4, 4, 4], [5, 1, 7, 3, 3], [1] * 9, [30]])
@pytest.mark.parametrize("window", [1, 3, 8, 1000])
def test_an_epochs_order_is_every_sample_once_within_its_window(sizes: list[int], window: int):
    order = ShardWindowOrder(sizes, seed=1, epoch=2, window=window)
    indices = [order[p] for p in range(len(order))]
    assert sorted(indices) == list(range(sum(sizes)))
    # Window w holds the samples of positions w·window … of the shard order laid end to end: no
    # more.
    laid = [order.first_index[k] + j for k, s in enumerate(order.shards) for j in range(sizes[s])]
    for start in range(0, len(laid), window):
        assert sorted(indices[start : start + window]) == sorted(laid[start : start + window])
    others = [ShardWindowOrder(sizes, seed=1, epoch=e, window=window) for e in (3, 4, 5)]
    if len(sizes) > 1 or window > 1:  # a new order each epoch
        assert any([other[p] for p in range(len(other))] != indices for other in others)
    unshuffled = ShardWindowOrder(sizes, seed=1, epoch=2, window=window, shuffle=False)
    assert [unshuffled[p] for p in range(len(unshuffled))] == list(range(sum(sizes)))


def _sampler(dataset, rank: int, world: int, pad: bool, epoch: int = 0) -> ShardWindowSampler:
    sampler = ShardWindowSampler(
        dataset, num_replicas=world, rank=rank, shuffle=True, seed=7, pad=pad
    )
    sampler.set_epoch(epoch)
    return sampler


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ranks_read_disjoint_parts_of_one_order_and_every_sample_once(tmp_path: Path, world: int):
    train, _ = shards.sharded(str(_write(tmp_path)), shuffle_window=5)
    parts = [list(_sampler(train, r, world, pad=False, epoch=1)) for r in range(world)]
    assert Counter(i for part in parts for i in part) == Counter(range(23))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1 and len(parts[0]) == max(
        map(len, parts)
    )
    padded = [list(_sampler(train, r, world, pad=True, epoch=1)) for r in range(world)]
    # every rank the same steps: the first positions repeated
    assert len({len(p) for p in padded}) == 1
    whole = list(_sampler(train, 0, 1, pad=False, epoch=1))
    extra = Counter(i for part in padded for i in part) - Counter(range(23))
    assert extra == Counter(whole[: -(-23 // world) * world - 23])


def test_a_resume_at_another_world_size_reads_every_remaining_sample_once(tmp_path: Path):
    train, _ = shards.sharded(str(_write(tmp_path, train=48)), shuffle_window=10)
    before = []
    for rank in range(2):  # 3 batches of 4 per rank at 2 ranks: global batch 8
        sampler = _sampler(train, rank, 2, pad=False)
        before += list(sampler)[:12]
    after = _sampler(train, 0, 1, pad=False)
    after.skip(3 * 8)  # the same 3 global batches, at one rank of batch 8
    assert Counter(before) + Counter(after) == Counter(range(48))
    resumed = _sampler(train, 1, 2, pad=False)
    resumed.skip(5)
    assert list(resumed) == list(_sampler(train, 1, 2, pad=False))[5:]


def test_training_loaders_read_shards_through_the_window_sampler(tmp_path: Path):
    _write(tmp_path)
    dataset = {"_target_": "hydra_ddp.data.sharded", "root": str(tmp_path), "shuffle_window": 5}
    settings = DataConf(
        dataset=dataset, batch_size=3, eval_batch_size=2, val_fraction=0, even_shards=False
    )
    cfg = OmegaConf.structured(settings)
    per_rank = [
        data.build_loaders(cfg, RankInfo(r, 2, r, 2), seed=0, device=torch.device("cpu"))
        for r in range(2)
    ]
    assert all(isinstance(loaders.train_sampler, ShardWindowSampler) for loaders in per_rank)
    labels = [int(y) for loaders in per_rank for _, y in loaders.train for y in y]
    assert sorted(labels) == list(range(23))
    tested = sorted(int(y) for loaders in per_rank for _, _, (_, ys) in loaders.test for y in ys)
    assert tested == list(range(1000, 1005))


def test_damage_is_one_line_naming_the_shard(tmp_path: Path):
    cfg = lambda root: {"_target_": "hydra_ddp.data.sharded", "root": str(root)}  # noqa: E731
    data_cfg = lambda root, **more: OmegaConf.create(  # noqa: E731
        {"dataset": cfg(root), "num_classes": 10, "in_channels": 1, "image_size": 2, **more}
    )
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="holds no shards"):
        data.check_source(data_cfg(tmp_path / "empty"))
    with pytest.raises(UserError, match="no such directory"):
        data.check_source(data_cfg(tmp_path / "missing"))
    root = _write(tmp_path / "ok")
    data.check_source(data_cfg(root))
    with pytest.raises(UserError, match=r"data.in_channels=3 but the shards .* in_channels=1"):
        data.check_source(data_cfg(root, in_channels=3))
    with pytest.raises(UserError, match="shuffle_window"):
        data.check_source(data_cfg(root, dataset={**cfg(root), "shuffle_window": 0}))
    shard = root / "train-000002.shard"
    content = shard.read_bytes()
    shard.write_bytes(content[:-10])  # truncated: found before launch, by its size
    with pytest.raises(UserError, match=r"train-000002.shard has \d+ bytes, its manifest says"):
        data.check_source(data_cfg(root))
    shard.write_bytes(b"garbage!" + content[8:])  # the same size, a broken header: found when read
    data.check_source(data_cfg(root))
    train, _ = shards.sharded(str(root))
    with pytest.raises(
        UserError, match=r"shard .*train-000002.shard is corrupt \(not a shard file"
    ):
        train[9]
    assert int(train[0][1]) == 0  # the other shards read on
    assert any("train-000002" in problem for problem in shard_tool.verify(root))
    # one bit of its data: only verify sees it
    shard.write_bytes(content[:-1] + bytes([content[-1] ^ 1]))
    assert [p for p in shard_tool.verify(root) if "CRC-32" in p] and len(
        shard_tool.verify(root)
    ) == 1
    shard.write_bytes(content)
    assert shard_tool.verify(root) == []
    (root / "manifest.json").write_text("{")
    with pytest.raises(UserError, match="manifest.json cannot be read"):
        data.check_source(data_cfg(root))
    (root / "manifest.json").unlink()
    with pytest.raises(UserError, match="8 shard files but no manifest.json"):
        data.check_source(data_cfg(root))


def test_the_command_line_writes_a_source_and_verifies_it(tmp_path: Path, capsys):
    out = tmp_path / "digits"
    assert (
        shard_tool.main(["write", str(out), "--samples-per-shard", "100", "--arg", "image_size=8"])
        == 0
    )
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["meta"] == {"source": "digits", "in_channels": 1, "image_size": 8}
    assert [sum(e["samples"] for e in manifest["splits"][s]) for s in ("train", "test")] == [
        1438,
        359,
    ]
    train, test = shards.sharded(str(out))
    reference = data.digits(image_size=8)[0]
    assert torch.equal(train[17][0], reference[17][0]) and train[17][1] == reference[17][1]
    assert shard_tool.main(["verify", str(out)]) == 0
    assert shard_tool.main(["write", str(out), "--source", "no_such_source"]) == 2
    assert "no such function" in capsys.readouterr().err


def test_a_format_1_directory_written_by_the_code_before_format_2_reads_as_it_was_written():
    # tests/data/shards_format1: written by shards.write at 414064d^ (format 1, before ragged
    # fields) from the samples below, seed 0; read by today's code, sample for sample.
    root = Path(__file__).resolve().parents[1] / "data" / "shards_format1"
    assert shards.read_manifest(root)["version"] == 1
    gen = torch.Generator().manual_seed(0)
    written = {
        "train": (torch.randn(10, 1, 4, 4, generator=gen), torch.arange(10) % 3),
        "test": (torch.randn(4, 1, 4, 4, generator=gen), torch.arange(4) % 3),
    }
    train, test = shards.sharded(str(root))
    assert (len(train), len(test)) == (10, 4)
    for split, (xs, ys) in zip((train, test), written.values()):
        for i in range(len(split)):
            x, y = split[i]
            assert torch.equal(x, xs[i]) and y.item() == ys[i].item() and y.dtype == torch.int64
    assert shard_tool.verify(root) == []
