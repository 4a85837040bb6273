"""Shard directories from the command line: write a data source's splits as shards, verify them.

    python -m hydra_ddp.tools.shards write outputs/shards/digits --source digits
    python -m hydra_ddp.tools.shards write DIR --source python_source --arg context=64 \
        --meta num_classes=256
    python -m hydra_ddp.tools.shards write DIR --source documents --tokenizer PATH \
        --arg files='corpus/*.txt'
    python -m hydra_ddp.tools.shards verify outputs/shards/digits

`--source`: a source of hydra_ddp.data (digits, python_source, documents, ...) or your own
module.function returning (train, test) or (train, val, test); `--arg KEY=VALUE` its arguments.
`--meta KEY=VALUE`: what data.* must say for this data (checked before a run); an image's channels
and size are found. `--tokenizer`: a tokenizer.json (or its folder) the source tokenizes with (its
`tokenizer` argument); data=documents trains one where none is given. Either way it is written
beside the shards, as transformers loads it, and the manifest records its vocabulary and padding id:
a document's token ids are stored whole (a ragged field) and padded per batch."""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import sys
import zlib
from pathlib import Path
from typing import Any, Optional

import torch

from hydra_ddp.data import shards
from hydra_ddp.errors import UserError


def verify(root: str | os.PathLike) -> list[str]:
    """Each shard's problems, read whole against its manifest entry (size, CRC-32, header): [] when
    all is well."""
    manifest = shards.read_manifest(root)
    problems = []
    for split, entries in manifest["splits"].items():
        for entry in entries:
            info = shards.ShardInfo(**entry)
            path = Path(root) / info.file
            try:
                shards.check_files(root, [info])
                crc = 0
                with open(path, "rb") as f:
                    while chunk := f.read(1 << 20):
                        crc = zlib.crc32(chunk, crc)
                if crc != info.crc32:
                    raise shards.ShardError(
                        f"shard {path}: its CRC-32 is {crc:08x}, the manifest's {info.crc32:08x}"
                    )
                shards.ShardFile(path, info)
            except shards.ShardError as e:
                problems.append(f"{split}: {e}")
    return problems


def _source(name: str) -> Any:
    """`digits` (a source of hydra_ddp.data) or `package.module.function`."""
    module, _, function = name.rpartition(".") if "." in name else ("hydra_ddp.data", "", name)
    try:
        return getattr(importlib.import_module(module), function)
    except (ImportError, AttributeError):
        raise UserError(
            f"--source {name}: no such function (a source of hydra_ddp.data, or module.function)"
        ) from None


def _pairs(args: list[str]) -> dict[str, Any]:
    """KEY=VALUE arguments, each value read as JSON where it is (numbers, true, lists), else a
    string."""
    pairs = {}
    for arg in args:
        key, equals, text = arg.partition("=")
        if not equals:
            raise UserError(f"{arg!r}: give KEY=VALUE")
        try:
            pairs[key] = json.loads(text)
        except ValueError:
            pairs[key] = text
    return pairs


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hydra_ddp.tools.shards", description=__doc__.split("\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    writing = commands.add_parser("write", help="write a data source's splits as shards")
    writing.add_argument("root", help="the directory to write (its manifest is replaced)")
    writing.add_argument(
        "--source", default="digits", help="digits, python_source, ... or module.function"
    )
    writing.add_argument("--samples-per-shard", type=int, default=64)
    writing.add_argument(
        "--arg", action="append", default=[], metavar="KEY=VALUE", help="an argument of the source"
    )
    writing.add_argument(
        "--meta", action="append", default=[], metavar="KEY=VALUE", help="what data.* must say"
    )
    writing.add_argument(
        "--tokenizer", help="a tokenizer.json (or its folder) for the source to tokenize with"
    )
    checking = commands.add_parser("verify", help="read every shard whole against its manifest")
    checking.add_argument("root")
    options = parser.parse_args(argv)
    try:
        if options.command == "verify":
            problems = verify(options.root)
            print("\n".join(problems) or f"{options.root}: every shard reads as written")
            return 1 if problems else 0
        source, arguments = _source(options.source), _pairs(options.arg)
        if options.tokenizer:
            arguments["tokenizer"] = options.tokenizer
        splits = source(**arguments)
        names = ("train", "val", "test") if len(splits) == 3 else ("train", "test")
        first = splits[0][0]
        meta = {
            **_meta(first, options.source),
            **_tokenizer_beside(source, arguments, options.root),
            **_pairs(options.meta),
        }
        manifest = shards.write(
            options.root, dict(zip(names, splits)), options.samples_per_shard, meta
        )
        for split, entries in manifest["splits"].items():
            print(f"{split}: {sum(e['samples'] for e in entries)} samples in {len(entries)} shards")
        print(f"written to {options.root} (meta: {json.dumps(meta)})")
        return 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _tokenizer_beside(source: Any, arguments: dict[str, Any], root: str) -> dict[str, Any]:
    """A text source's tokenizer written beside the shards (as transformers loads it), and what the
    manifest records of it: the vocabulary data.num_classes must hold, the padding id, the longest
    sequence. Nothing for a source without a tokenizer."""
    from hydra_ddp.data import text

    if "tokenizer" in arguments:
        tokenizer = text.load_tokenizer(arguments["tokenizer"])
    # data=documents: the one it trained
    elif getattr(source, "save_with_run", None) is text.save_with_run:
        tokenizer = text.run_tokenizer(arguments)
    else:
        return {}
    context = arguments.get("context", _default(source, "context"))
    text.save_tokenizer(tokenizer, Path(root), context)
    _, pad_id = text.special_ids(tokenizer)
    return {
        "vocab_size": tokenizer.get_vocab_size(),
        "pad_id": pad_id,
        "tokenizer": text.TOKENIZER_FILE,
        **({"context": context} if context else {}),
    }


def _default(source: Any, name: str) -> Any:
    """A source's default for one of its arguments, or None."""
    parameter = inspect.signature(source).parameters.get(name)
    return (
        None
        if parameter is None or parameter.default is inspect.Parameter.empty
        else parameter.default
    )


def _meta(sample: Any, source: str) -> dict[str, Any]:
    """What data.* must say for this data, as far as the sample shows it: an image's channels and
    size."""
    meta: dict[str, Any] = {"source": source}
    if (
        isinstance(sample, (tuple, list))
        and isinstance(sample[0], torch.Tensor)
        and sample[0].dim() == 3
    ):
        channels, height, width = sample[0].shape
        if height == width:
            meta.update(in_channels=int(channels), image_size=int(height))
    return meta


if __name__ == "__main__":
    sys.exit(main())
