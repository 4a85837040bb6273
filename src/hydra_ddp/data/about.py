"""What a run read, in numbers: the run's first lines and its summary's `data` say how much text it
trained on and how much of each batch was text (data=documents; other sources say nothing here).

- files: how many the glob `data.dataset.files` matched (null: Python's standard library's source);
- documents and tokens: the training split's, before validation is carved from it (a document is
  cut into pieces of at most `context` tokens, its end-of-text included);
- padded per batch: the share of rank 0's first-epoch micro-batches that is tokens, not padding
  (sorting by length, data.group_by_length, raises it); packed: how many windows, and the share
  of them that is tokens.
"""

from __future__ import annotations

import glob
import os
from typing import Any, Optional

import torch
from torch.utils.data import Subset

from hydra_ddp.config.schema import DataConf
from hydra_ddp.data.batches import lengths_of


def about(data_cfg: DataConf, loaders: Any) -> Optional[dict[str, Any]]:
    """The numbers above for data=documents' training set, or None for any other source."""
    train = loaders.train_sampler.dataset
    source = train
    while isinstance(source, Subset):
        source = source.dataset
    counts = getattr(source, "about", None)  # set by data.text.documents
    if counts is None:
        return None
    pattern = data_cfg.dataset.get("files")
    found: dict[str, Any] = {
        "files": len(glob.glob(os.path.expanduser(pattern), recursive=True)) if pattern else None,
        **counts,
    }
    lengths = lengths_of(train)
    if lengths is None:  # packed into windows of `context`
        found["text_share"] = counts["tokens"] / (
            counts["windows"] * int(data_cfg.dataset["context"])
        )
        return found
    order = torch.as_tensor(list(iter(loaders.train_sampler)), dtype=torch.int64)
    found["text_share"] = text_share(lengths[order], loaders.batch_size)
    return found


def text_share(lengths: torch.Tensor, batch_size: int) -> float:
    """Of micro-batches of `batch_size` consecutive samples of these lengths, each padded to its
    longest: the share of their places that holds tokens."""
    tokens = padded = 0
    for batch in lengths.split(batch_size) if len(lengths) else ():
        tokens += int(batch.sum())
        padded += int(batch.max()) * len(batch)
    return tokens / padded if padded else 1.0


def line(found: dict[str, Any]) -> str:
    """The run's log line."""
    where = f"{found['files']} file(s)" if found["files"] is not None else "Python's own source"
    share = f"{100 * found['text_share']:.1f} % text"
    how = (
        f"packed into {found['windows']:,} windows: {share}"
        if "windows" in found
        else f"padded per batch: {share} in rank 0's first epoch"
    )
    return (
        f"data: {where}, {found['documents']:,} documents, {found['tokens']:,} tokens in the "
        f"training split; {how}"
    )
