"""Text as language models train on it: documents of different lengths, a byte-level BPE tokenizer
trained here (Hugging Face `tokenizers`; nothing downloaded), and two ways to batch them.

- **Padding** (`packing=false`): each document is a sample (`input_ids`, ending with the
  end-of-text token); a batch is padded to its own longest (PadCollate: `attention_mask`, and
  `labels` of -100 on the padding). `data.group_by_length` sorts samples by length within windows
  of global batches, so a batch holds documents of similar lengths and less padding.
- **Packing** (`packing=true`): documents laid into fixed windows of `context` tokens, each whole
  (best-fit decreasing: the longest first, each into the window it fills most tightly), the rest of
  a window padding. `position_ids` restart at each document, and a document's first label is -100:
  a model that reads them (transformers' with sdpa or flash attention, the built-in GPT) attends
  and predicts within each document only.

A document longer than `context` is cut into pieces of `context` tokens, each then a document of its
own (the same pieces either way). Every order here is a function of the data and the seed, so a
resumed run reads the same batches; the training order itself is the sampler's (seed, epoch).
"""

from __future__ import annotations

import bisect
import functools
import glob
import inspect
import json
import os
import re
import sysconfig
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

import torch
from torch.utils.data import Dataset, default_collate

from hydra_ddp.data.batches import IGNORED, TensorTree
from hydra_ddp.errors import UserError, install_line

# the special tokens a trained tokenizer starts with: ids 0 and 1
END_OF_TEXT, PAD = "<|endoftext|>", "<pad>"
TOKENIZER_FILE = "tokenizer.json"
_NEEDS = (
    f"data=documents needs Hugging Face tokenizers: {install_line('tokenizers', 'transformers')}"
)


# --- the text ------------------------------------------------------------------------------------
def python_documents(max_bytes: int) -> list[str]:
    """The standard library's own top-level source files (text every Python ships), in name order,
    cut into documents at each definition of a module or a class (a decorator stays with what it
    decorates): a module's header, a class's header, each function and method; from a few dozen to
    a few thousand tokens. Up to max_bytes of files in all."""
    root = Path(sysconfig.get_paths()["stdlib"])
    documents: list[str] = []
    size = 0
    for path in sorted(root.glob("*.py")):
        current: list[str] = []
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True):
            if _DEFINITION.match(line) and any(
                kept.strip() and not kept.lstrip().startswith("@") for kept in current
            ):
                documents.append("".join(current))
                current = []
            current.append(line)
        documents.append("".join(current))
        size += path.stat().st_size
        if size >= max_bytes:
            break
    return [document.strip("\n") + "\n" for document in documents if document.strip()]


_DEFINITION = re.compile(r" {0,4}(def |class |async def |@)")  # a module's or a class's definitions


def file_documents(pattern: str) -> list[str]:
    """Your own text: every file matching `pattern` (a glob; ** for subfolders) in name order, each
    a document; a .jsonl file gives one document per line, its "text" field."""
    paths = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
    if not paths:
        raise UserError(
            f"data.dataset.files={pattern!r} matches no file; "
            "give a glob of text files (e.g. corpus/*.txt)"
        )
    documents = []
    for path in paths:
        if path.endswith(".jsonl"):
            with open(path, encoding="utf-8") as lines:
                documents += [json.loads(line)["text"] for line in lines if line.strip()]
        else:
            documents.append(Path(path).read_text(encoding="utf-8", errors="replace"))
    return [document for document in documents if document]


# --- the tokenizer -------------------------------------------------------------------------------
def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Any:
    """A byte-level BPE (GPT-2's kind: any text, no unknown token) of `vocab_size` ids, trained on
    `texts`, with END_OF_TEXT and PAD as ids 0 and 1. The same texts give the same tokenizer, in any
    process and at any thread count."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise UserError(_NEEDS) from None
    if vocab_size < 258:
        raise UserError(
            f"data.dataset.vocab_size={vocab_size}: a byte-level "
            "BPE needs at least 258 (256 bytes, 2 specials)"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(texts), trainer)
    return tokenizer


def tokenizer_path(path: str) -> Path:
    """A tokenizer's file: `path` itself, or the tokenizer.json in the folder `path` names."""
    found = Path(path).expanduser()
    found = found / TOKENIZER_FILE if found.is_dir() else found
    if not found.is_file():
        raise UserError(
            f"data.dataset.tokenizer={path!r}: no tokenizer there; give a "
            "tokenizer.json (or its folder), or null to train one on the data"
        )
    return found


def load_tokenizer(path: str) -> Any:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UserError(_NEEDS) from None
    try:
        return Tokenizer.from_file(str(tokenizer_path(path)))
    except Exception as error:  # noqa: BLE001  (the library's own complaint about the file)
        raise UserError(
            f"data.dataset.tokenizer={path!r} does not load as a tokenizer: {error}"
        ) from None


def special_ids(tokenizer: Any) -> tuple[int, int]:
    """(end of text, padding) ids of a tokenizer; one line when it lacks them."""
    ids = tokenizer.token_to_id(END_OF_TEXT), tokenizer.token_to_id(PAD)
    if None in ids:
        raise UserError(
            f"the tokenizer has no {END_OF_TEXT} or {PAD} token (documents end "
            "with the one, batches are padded with the other): add them as "
            "special tokens, or leave data.dataset.tokenizer null to train one"
        )
    return ids  # type: ignore[return-value]


def save_tokenizer(tokenizer: Any, folder: Path, context: Optional[int] = None) -> Path:
    """The tokenizer as transformers loads it (`AutoTokenizer.from_pretrained(folder)`, or
    `PreTrainedTokenizerFast(tokenizer_file=...)`): tokenizer.json and its config, written
    atomically."""
    folder.mkdir(parents=True, exist_ok=True)
    special = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": END_OF_TEXT,  # as the model's config says (export.py): nothing starts a text
        "eos_token": END_OF_TEXT,
        "pad_token": PAD,
    }
    if context:
        special["model_max_length"] = context
    for name, text in (
        (TOKENIZER_FILE, tokenizer.to_str()),
        ("tokenizer_config.json", json.dumps(special, indent=1)),
    ):
        temporary = folder / f".{name}.tmp"
        temporary.write_text(text)
        os.replace(temporary, folder / name)
    return folder


# --- tokenized documents -------------------------------------------------------------------------
def tokenize(tokenizer: Any, documents: Sequence[str], context: int) -> list[torch.Tensor]:
    """Each document's ids with the end-of-text id appended, cut into pieces of at most
    `context`."""
    end, _ = special_ids(tokenizer)
    pieces = []
    for encoding in tokenizer.encode_batch(list(documents), add_special_tokens=False):
        ids = torch.tensor([*encoding.ids, end], dtype=torch.int32)
        pieces += list(ids.split(context))
    return pieces


class TokenDocuments(Dataset):
    """Documents as token ids of different lengths, held as one flat tensor and offsets: sample i is
    {"input_ids": its ids}. PadCollate batches them (`collate`); `lengths` orders them for
    data.group_by_length."""

    draws_randomness = False  # samples as tokenized: no per-sample seeding (data/loading.py)

    def __init__(self, pieces: Sequence[torch.Tensor], pad_id: int):
        self.ids = torch.cat(list(pieces)) if pieces else torch.zeros(0, dtype=torch.int32)
        self.lengths = torch.tensor([len(piece) for piece in pieces], dtype=torch.int64)
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.int64), self.lengths.cumsum(0)])
        self.collate = PadCollate(pad_id)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        start, end = self.offsets[index].item(), self.offsets[index + 1].item()
        return {"input_ids": self.ids[start:end].long()}


class PadCollate:
    """Samples of token ids of different lengths into one batch padded on the right to its longest:
    `input_ids` (padded with the padding id), `attention_mask` (0 on the padding) and `labels` (the
    ids, -100 on the padding: it counts in no loss). A sample's own `labels` are kept, padded with
    -100; its other fields are batched as DataLoader batches them. Packed samples (with
    `position_ids`) get no attention mask: transformers reads packed documents from restarting
    position ids only where no mask is given (an all-ones one would let them attend across)."""

    pads_per_batch = True  # its batches' lengths vary (recipe/compiling.py compiles them dynamic)

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        longest = max(len(sample["input_ids"]) for sample in samples)
        ids = torch.full((len(samples), longest), self.pad_id, dtype=torch.int64)
        labels = torch.full((len(samples), longest), IGNORED, dtype=torch.int64)
        mask = torch.zeros((len(samples), longest), dtype=torch.int64)
        for row, sample in enumerate(samples):
            tokens = sample["input_ids"]
            ids[row, : len(tokens)] = tokens
            labels[row, : len(tokens)] = sample.get("labels", tokens)
            mask[row, : len(tokens)] = 1
        others = {
            key: default_collate([s[key] for s in samples])
            for key in samples[0]
            if key not in _PADDED
        }
        masked = {} if "position_ids" in samples[0] else {"attention_mask": mask}
        return {"input_ids": ids, **masked, "labels": labels, **others}


_PADDED = ("input_ids", "attention_mask", "labels")  # what PadCollate pads


def pack(lengths: Sequence[int], window: int) -> list[list[int]]:
    """Best-fit decreasing: the pieces (each at most `window` long) into windows, each piece whole.
    The longest first (ties in index order), each into the window whose free space it fills most
    tightly, else a new one. Returns each window's pieces, in the order they were laid."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    windows: list[list[int]] = []
    # free space → windows with that much left (the last added first)
    by_space: dict[int, list[int]] = {}
    spaces: list[int] = []  # the free spaces some window has, ascending
    for piece in order:
        need = lengths[piece]
        at = bisect.bisect_left(spaces, need)
        if at < len(spaces):
            space = spaces[at]
            chosen = by_space[space].pop()
            if not by_space[space]:
                del by_space[space], spaces[at]
        else:
            space, chosen = window, len(windows)
            windows.append([])
        windows[chosen].append(piece)
        left = space - need
        if left:
            if left not in by_space:
                by_space[left] = []
                bisect.insort(spaces, left)
            by_space[left].append(chosen)
    return windows


def packed(pieces: Sequence[torch.Tensor], window: int, pad_id: int) -> TensorTree:
    """The pieces packed into windows of `window` tokens (pack): whole tensors of `input_ids`,
    `labels` (-100 on each piece's first token, which no earlier token of its window may predict,
    and on the padding) and `position_ids` (from 0 at each piece, and at the padding)."""
    layout = pack([len(piece) for piece in pieces], window)
    ids = torch.full((len(layout), window), pad_id, dtype=torch.int64)
    labels = torch.full((len(layout), window), IGNORED, dtype=torch.int64)
    positions = torch.zeros((len(layout), window), dtype=torch.int64)
    for row, members in enumerate(layout):
        at = 0
        for piece in members:
            tokens = pieces[piece]
            ids[row, at : at + len(tokens)] = tokens
            labels[row, at + 1 : at + len(tokens)] = tokens[1:]
            positions[row, at : at + len(tokens)] = torch.arange(len(tokens))
            at += len(tokens)
        positions[row, at:] = torch.arange(window - at)  # the padding: a sequence of its own
    return TensorTree({"input_ids": ids, "labels": labels, "position_ids": positions})


def documents(
    context: int = 256,
    packing: bool = False,
    tokenizer: Optional[str] = None,
    vocab_size: int = 1024,
    files: Optional[str] = None,
    max_bytes: int = 524_288,
    test_fraction: float = 0.1,
    seed: int = 0,
) -> tuple[Dataset, Dataset]:
    """Tokenized documents, (train, test) split by document with a permutation seeded by `seed`:
    padded per batch, or packed into windows of `context` tokens (`packing`). The text: your own
    `files` (a glob), else the standard library's source up to `max_bytes`. `tokenizer`: a
    tokenizer.json (or its folder); null trains a byte-level BPE of `vocab_size` ids on the training
    documents (the same one in every process: training it is deterministic)."""
    if context < 2:
        raise UserError(f"data.dataset.context={context}: at least 2 tokens (a token and the next)")
    splits = _split_documents(files, max_bytes, test_fraction, seed)
    trained = (
        load_tokenizer(tokenizer)
        if tokenizer
        else _trained(files, max_bytes, test_fraction, seed, vocab_size)
    )
    _, pad_id = special_ids(trained)
    built = []
    for split in splits:
        pieces = tokenize(trained, split, context)
        made = packed(pieces, context, pad_id) if packing else TokenDocuments(pieces, pad_id)
        # what the run says it read (data/about.py)
        made.about = {"documents": len(split), "tokens": sum(len(piece) for piece in pieces)}
        if packing:
            made.about["windows"] = len(made)
        built.append(made)
    return built[0], built[1]


documents.requires = (  # type: ignore[attr-defined]  (checked before launch: launch/checks.py)
    ("tokenizers", "Hugging Face tokenizers", install_line("tokenizers", "transformers")),
)


def _split_documents(
    files: Optional[str], max_bytes: int, test_fraction: float, seed: int
) -> list[list[str]]:
    """[train, test] documents: a permutation seeded by `seed` holds out `test_fraction` of them."""
    texts = file_documents(files) if files else python_documents(max_bytes)
    if len(texts) < 2:
        raise UserError(
            f"data=documents: {len(texts)} document(s) make no train and test split; give more text"
        )
    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(seed)).tolist()
    held = max(1, round(len(texts) * test_fraction))
    return [[texts[i] for i in sorted(order[held:])], [texts[i] for i in sorted(order[:held])]]


def run_tokenizer(dataset_cfg: Mapping[str, Any]) -> Any:
    """The tokenizer data=documents with these settings tokenizes with: its file, or the one trained
    on its training documents."""
    given = {name: value for name, value in dataset_cfg.items() if name != "_target_"}
    chosen = inspect.signature(documents).bind(**given)
    chosen.apply_defaults()
    source = chosen.arguments
    if source["tokenizer"]:
        return load_tokenizer(source["tokenizer"])
    return _trained(
        source["files"],
        source["max_bytes"],
        source["test_fraction"],
        source["seed"],
        source["vocab_size"],
    )


@functools.lru_cache(maxsize=4)
def _trained(
    files: Optional[str], max_bytes: int, test_fraction: float, seed: int, vocab_size: int
) -> Any:
    """The tokenizer trained on these settings' training documents, once a process (the dataset and
    the copy saved with the run are one)."""
    train, _ = _split_documents(files, max_bytes, test_fraction, seed)
    return train_tokenizer(train, vocab_size)


def save_with_run(dataset_cfg: Mapping[str, Any], run_dir: Path) -> Path:
    """The run's tokenizer into <run>/tokenizer/, as transformers loads it (rank 0, at the
    start)."""
    return save_tokenizer(
        run_tokenizer(dataset_cfg), run_dir / "tokenizer", dataset_cfg.get("context")
    )


documents.save_with_run = save_with_run  # type: ignore[attr-defined]


def vocabulary_size(dataset_cfg: Mapping[str, Any]) -> int:
    """The ids data=documents gives, from its config alone (a tokenizer file is read, not
    trained)."""
    if dataset_cfg.get("tokenizer"):
        return load_tokenizer(dataset_cfg["tokenizer"]).get_vocab_size()
    return dataset_cfg.get(
        "vocab_size", inspect.signature(documents).parameters["vocab_size"].default
    )
