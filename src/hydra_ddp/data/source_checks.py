"""Before launch, from the config alone: the files a shipped source reads are there and fit
data.* (check_source), and the shape of the language-model data shipped here (text_shape). A
user's own `_target_` is checked when it is built."""

from __future__ import annotations

import glob
import inspect
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from hydra_ddp.config.schema import DataConf
from hydra_ddp.data import shards, text
from hydra_ddp.data.sources import CIFAR10_FILES, python_source, python_source_dicts, split_folders
from hydra_ddp.errors import UserError


def text_shape(data_cfg: DataConf) -> tuple[Optional[int], Optional[int]]:
    """(the longest sequence, the vocabulary) of the language-model data shipped here, from its
    config alone (a tokenizer file is read, none is trained); (None, None) for other data."""
    dataset_cfg = data_cfg.dataset
    target = str(dataset_cfg.get("_target_", ""))
    if target.endswith(".documents"):
        return _setting(dataset_cfg, text.documents, "context"), text.vocabulary_size(dataset_cfg)
    if target.endswith(".python_source"):
        return _setting(dataset_cfg, python_source, "context"), 256
    if target.endswith(".python_source_dicts"):
        return _setting(dataset_cfg, python_source_dicts, "tokens"), 256
    if target.endswith(".sharded"):
        meta = shards.read_manifest(dataset_cfg.get("root")).get("meta", {})
        return meta.get("context"), meta.get("vocab_size")
    return None, None


def _setting(dataset_cfg: Mapping[str, Any], source: Any, name: str) -> Any:
    """A source's argument as configured, else its default."""
    return dataset_cfg.get(name, inspect.signature(source).parameters[name].default)


def check_source(data_cfg: DataConf) -> None:
    """Fail before launch, naming the path, when a dataset's files are missing.

    Checks the datasets shipped here that read from disk; a user's own `_target_` is checked
    when it is built.
    """
    dataset_cfg, num_classes = data_cfg.dataset, data_cfg.num_classes
    target = str(dataset_cfg.get("_target_", ""))
    root = dataset_cfg.get("root")
    grouped = getattr(data_cfg, "group_by_length", None)
    if grouped is not None:
        if target.endswith(".documents"):  # padded documents vary in length; packed windows do not
            what = "packed windows are one length" if dataset_cfg.get("packing") else None
        elif target.endswith(".sharded"):
            what = "a shard directory is read in shard windows"
        # the sources shipped here: only documents vary in length
        elif target.startswith("hydra_ddp.data."):
            what = f"the samples of {target.rsplit('.', 1)[1]} are all one size"
        else:
            what = None  # a dataset of yours: its `lengths`, or one line from the workers
        if what:
            raise UserError(
                f"data.group_by_length={grouped}: {what}, nothing to group; leave it null"
            )
    if target.endswith(".documents"):
        if dataset_cfg.get("files"):
            _check_files(dataset_cfg["files"])
        vocabulary = text.vocabulary_size(dataset_cfg)
        if vocabulary > num_classes:
            raise UserError(
                f"data=documents: the tokenizer makes {vocabulary} ids, "
                f"and data.num_classes={num_classes} (the model's "
                f"vocabulary reads it): set data.num_classes={vocabulary}"
            )
    elif target.endswith(".sharded"):
        shards.check(dataset_cfg, data_cfg)
    elif target.endswith(".image_folder"):
        path = _require_dir(root, "data=imagefolder")
        folders = split_folders(path) or {"": path}
        found = {split: _class_folders(folder) for split, folder in folders.items()}
        classes = found.get("train", found.get(""))
        for split, names in found.items():
            if names != classes:
                raise UserError(
                    f"data=imagefolder: {str(folders[split])!r} has classes {names}, train/ has "
                    f"{classes}: every split needs the same class folders"
                )
        if len(classes) != num_classes:
            raise UserError(
                f"data=imagefolder: {str(path)!r} has {len(classes)} classes but "
                f"data.num_classes={num_classes}; set data.num_classes={len(classes)}"
            )
    elif target.endswith((".mnist", ".cifar10")) and not dataset_cfg.get("download", False):
        path = _require_dir(root, f"data={target.rsplit('.', 1)[1]}")
        missing = [n for n in CIFAR10_FILES if not (path / "cifar-10-batches-py" / n).is_file()]
        if target.endswith(".cifar10") and missing:
            raise UserError(
                f"data=cifar10: {str(path / 'cifar-10-batches-py')!r} lacks "
                f"{', '.join(missing)} (CIFAR-10's python version); set data.dataset.root, "
                "or data.dataset.download=true where the network allows"
            )


def _class_folders(path: Path) -> list[str]:
    from torchvision.datasets.folder import IMG_EXTENSIONS

    classes = sorted(d.name for d in os.scandir(path) if d.is_dir())
    if not classes:
        raise UserError(
            f"data=imagefolder: {str(path)!r} has no class "
            "subfolders (expected root/<class>/<image>)"
        )
    empty = [
        c
        for c in classes
        if not any(f.lower().endswith(IMG_EXTENSIONS) for f in os.listdir(path / c))
    ]
    if empty:
        raise UserError(
            f"data=imagefolder: class folder(s) {empty} under {str(path)!r} hold no images"
        )
    return classes


def _require_dir(root: str, what: str) -> Path:
    path = Path(root).expanduser().resolve()
    if not path.is_dir():
        raise UserError(
            f"{what}: directory {str(path)!r} does not exist; set data.dataset.root to it"
        )
    return path


def _check_files(pattern: str) -> None:
    """data.dataset.files, before launch: a glob that matches files (a folder is not one)."""
    where = os.path.expanduser(pattern)
    if os.path.isdir(where):
        raise UserError(
            f"data.dataset.files={pattern!r} is a folder; give a glob of its text files: "
            f"data.dataset.files='{pattern.rstrip('/')}/**/*.txt' (** for its subfolders)"
        )
    if not any(os.path.isfile(path) for path in glob.iglob(where, recursive=True)):
        raise UserError(
            f"data.dataset.files={pattern!r} matches no file; "
            "give a glob of text files (e.g. corpus/*.txt)"
        )
