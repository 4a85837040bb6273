"""The streaming reader's throughput: samples/s of the loader alone (no model), against the \
in-memory
map-style loader on the same samples, and against the field's streaming libraries on the same
samples in their own formats, at 0, 1 and 2 loader workers.

    # ours only (map-style, shards, StatefulDataLoader if installed):
    .venv/bin/python bench/streaming.py
    .venv/bin/pip install webdataset datasets litdata torchdata
    .venv/bin/python bench/streaming.py

The data: scikit-learn's digits as the default run holds them (1,438 training samples of 1×28×28
float32 and a label), repeated --repeat times (each repeat the same samples: a reader's cost, not
the data's, is measured), written as shards of --per-shard samples: our shard files, tar files of
.npy (webdataset), Parquet files (Hugging Face datasets, streamed) and litdata's chunks. Each loader
reads batches of 64 with shuffling on, persistent workers where the loader has them; an epoch is
read once to start the workers and warm the page cache, then --epochs epochs are timed, the loaders
in turns (round-robin, the order reversed every other round) so that a slow spell of the machine
falls on all of them. Result: bench/results/streaming_<commit>.json. """

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import provenance  # noqa: E402

from hydra_ddp.data import digits, shards  # noqa: E402
from hydra_ddp.data.loading import loader_options  # noqa: E402
from hydra_ddp.data.sampling import ResumableDistributedSampler, ShardWindowSampler  # noqa: E402

BATCH = 64


def _settings(workers: int) -> SimpleNamespace:
    return SimpleNamespace(
        num_workers=workers, pin_memory=False, persistent_workers=True, prefetch_factor=None
    )


def ours_in_memory(images: torch.Tensor, labels: torch.Tensor, workers: int, _: Path) -> Any:
    dataset = TensorDataset(images, labels)
    sampler = ResumableDistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    return sampler, DataLoader(dataset, batch_size=BATCH, sampler=sampler, **_opts(workers))


def ours_shards(images: torch.Tensor, labels: torch.Tensor, workers: int, root: Path) -> Any:
    train, _ = shards.sharded(str(root / "ours"))
    sampler = ShardWindowSampler(train, num_replicas=1, rank=0, shuffle=True, seed=0)
    return sampler, DataLoader(train, batch_size=BATCH, sampler=sampler, **_opts(workers))


def torchdata_stateful(images: torch.Tensor, labels: torch.Tensor, workers: int, root: Path) -> Any:
    from torchdata.stateful_dataloader import StatefulDataLoader

    train, _ = shards.sharded(str(root / "ours"))
    sampler = ShardWindowSampler(train, num_replicas=1, rank=0, shuffle=True, seed=0)
    return sampler, StatefulDataLoader(train, batch_size=BATCH, sampler=sampler, **_opts(workers))


def webdataset_tar(images: torch.Tensor, labels: torch.Tensor, workers: int, root: Path) -> Any:
    import webdataset as wds

    urls = sorted(str(p) for p in (root / "wds").glob("*.tar"))
    dataset = (
        wds.WebDataset(
            urls, shardshuffle=len(urls), nodesplitter=wds.split_by_node, empty_check=False
        )
        .shuffle(1000)
        .decode()
        .to_tuple("x.npy", "cls")
        .map_tuple(torch.from_numpy, int)
        .batched(BATCH)
    )
    options = {"persistent_workers": True} if workers else {}
    return None, wds.WebLoader(dataset, batch_size=None, num_workers=workers, **options)


def hf_datasets_streaming(
    images: torch.Tensor, labels: torch.Tensor, workers: int, root: Path
) -> Any:
    import datasets

    files = sorted(str(p) for p in (root / "parquet").glob("*.parquet"))
    stream = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)
    stream = stream.shuffle(seed=0, buffer_size=1000).with_format("torch")
    options = {"persistent_workers": True} if workers else {}
    return None, DataLoader(stream, batch_size=BATCH, num_workers=workers, **options)


def litdata_chunks(images: torch.Tensor, labels: torch.Tensor, workers: int, root: Path) -> Any:
    import litdata

    dataset = litdata.StreamingDataset(str(root / "litdata"), shuffle=True, seed=0)
    return None, litdata.StreamingDataLoader(dataset, batch_size=BATCH, num_workers=workers)


def _opts(workers: int) -> dict[str, Any]:
    options = loader_options(_settings(workers), seed=0, device=torch.device("cpu"))
    options.pop("generator")
    return options


LOADERS: dict[str, tuple[Callable[..., Any], str]] = {
    "in memory, map-style (ours, data=digits)": (ours_in_memory, ""),
    "shards (ours, data=shards)": (ours_shards, ""),
    "shards through torchdata's StatefulDataLoader": (torchdata_stateful, "torchdata"),
    "webdataset tar shards": (webdataset_tar, "webdataset"),
    "Hugging Face datasets, Parquet streamed": (hf_datasets_streaming, "datasets"),
    "litdata chunks": (litdata_chunks, "litdata"),
}


def write_formats(
    images: torch.Tensor, labels: torch.Tensor, root: Path, per_shard: int
) -> dict[str, float]:
    """The same samples in each format present; the seconds each took to write."""
    samples = list(zip(images, labels))
    took = {}
    started = time.perf_counter()
    shards.write(root / "ours", {"train": samples, "test": samples[:BATCH]}, per_shard)
    took["ours"] = time.perf_counter() - started
    if _has("webdataset"):
        import webdataset as wds

        (root / "wds").mkdir()
        started = time.perf_counter()
        with wds.ShardWriter(str(root / "wds" / "%06d.tar"), maxcount=per_shard, verbose=0) as sink:
            for i, (x, y) in enumerate(samples):
                buffer = io.BytesIO()
                np.save(buffer, x.numpy())
                sink.write({"__key__": f"{i:08d}", "x.npy": buffer.getvalue(), "cls": int(y)})
        took["webdataset"] = time.perf_counter() - started
    if _has("datasets"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        (root / "parquet").mkdir()
        started = time.perf_counter()
        flat = images.reshape(len(images), -1).numpy()
        for number, start in enumerate(range(0, len(samples), per_shard)):
            part = slice(start, start + per_shard)
            table = pa.table({"x": list(flat[part]), "y": labels[part].numpy()})
            pq.write_table(table, root / "parquet" / f"{number:06d}.parquet")
        took["datasets"] = time.perf_counter() - started
    if _has("litdata"):
        import litdata

        started = time.perf_counter()
        litdata.optimize(
            fn=_litdata_sample,
            inputs=[(x.numpy(), int(y)) for x, y in samples],
            output_dir=str(root / "litdata"),
            chunk_size=per_shard,
            num_workers=1,
        )
        took["litdata"] = time.perf_counter() - started
    return took


def _litdata_sample(item: tuple[np.ndarray, int]) -> dict[str, Any]:
    return {"x": item[0], "y": item[1]}


def _has(module: str) -> bool:
    import importlib.util

    return not module or importlib.util.find_spec(module) is not None


def epoch_seconds(sampler: Any, loader: Any, epoch: int) -> tuple[float, int]:
    if sampler is not None:
        sampler.set_epoch(epoch)
    started, count = time.perf_counter(), 0
    for batch in loader:
        count += len(batch[1] if isinstance(batch, (tuple, list)) else batch["y"])
    return time.perf_counter() - started, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--repeat", type=int, default=16, help="copies of the digits' training split"
    )
    parser.add_argument("--per-shard", type=int, default=256)
    parser.add_argument(
        "--epochs", type=int, default=3, help="timed epochs per loader and worker count"
    )
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    torch.set_num_threads(1)
    train, _ = digits()
    images, labels = (t.repeat(args.repeat, *[1] * (t.dim() - 1)) for t in train.tensors)
    available = {name: build for name, (build, module) in LOADERS.items() if _has(module)}
    missing = [module for _, module in LOADERS.values() if not _has(module)]
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        write_s = write_formats(images, labels, root, args.per_shard)
        rates: dict[str, dict[int, list[float]]] = {
            name: {w: [] for w in args.workers} for name in available
        }
        errors: dict[str, str] = {}
        for workers in args.workers:
            loaders = {}
            for name, build in available.items():
                try:
                    loaders[name] = build(images, labels, workers, root)
                    # workers started, pages cached
                    seconds, count = epoch_seconds(*loaders[name], epoch=0)
                    assert count == len(images), f"{count} samples read, not {len(images)}"
                except Exception as error:  # noqa: BLE001  (recorded: one library's failure is a result too)
                    errors[f"{name} @ {workers}"] = f"{type(error).__name__}: {error}"[:300]
                    loaders.pop(name, None)
            for round_ in range(args.epochs):
                order = list(loaders) if round_ % 2 == 0 else list(reversed(loaders))
                for name in order:
                    seconds, count = epoch_seconds(*loaders[name], epoch=round_ + 1)
                    rates[name][workers].append(count / seconds)
            del loaders
    base = {w: statistics.median(rates[next(iter(LOADERS))][w]) for w in args.workers}
    result = {
        **provenance.header(),
        "beside": os.environ.get("BENCH_BESIDE", "nothing noted"),
        "data": f"digits' training split ×{args.repeat}: {len(images)} samples "
        f"of 1×28×28 float32 + a label, shards of {args.per_shard}; "
        f"batches of {BATCH}, shuffled; 1 torch thread",
        "versions": {
            m: _version(m) for m in ("torch", "torchdata", "webdataset", "datasets", "litdata")
        },
        "not_installed": missing,
        "write_s": write_s,
        "samples_per_s_median": {
            name: {str(w): statistics.median(r) if r else None for w, r in by.items()}
            for name, by in rates.items()
        },
        "vs_in_memory": {
            name: {str(w): statistics.median(r) / base[w] if r else None for w, r in by.items()}
            for name, by in rates.items()
        },
        "samples_per_s": {name: {str(w): r for w, r in by.items()} for name, by in rates.items()},
        "errors": errors,
    }
    out = REPO / "bench" / "results" / f"streaming_{result['commit']}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    width = max(map(len, rates))
    print(f"samples/s (median of {args.epochs} epochs), and against the in-memory loader:")
    for name, by in result["samples_per_s_median"].items():
        cells = [
            f"{w}: {v:9.0f} ({result['vs_in_memory'][name][w]:.2f}×)" if v else f"{w}: -"
            for w, v in by.items()
        ]
        print(f"  {name:<{width}}  " + "   ".join(cells))
    for where, error in errors.items():
        print(f"  failed: {where}: {error}")
    print(
        f"written to {out.relative_to(REPO)}"
        + (" (from a dirty tree: not a result to keep)" if result["dirty"] else "")
    )


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:  # noqa: BLE001
        return None


if __name__ == "__main__":
    main()
