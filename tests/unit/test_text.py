"""Text as language models train on it (data/text.py): the tokenizer trained here, padding, packing
whole documents with attention inside each, grouping by length, and what a token-weighted task
counts. Packed documents' losses equal the same documents run alone, within float-sum noise."""

from __future__ import annotations

import json

import pytest
import torch

from hydra_ddp.config.schema import register_schema
from hydra_ddp.data import sampling, text
from hydra_ddp.errors import UserError
from hydra_ddp.models import TinyGPT, same_document_causal_mask
from hydra_ddp.tasks import CausalLM, LanguageModel, packing_warning

from support import resolved

# the transformers extra: .ci/run installs it; under CI=true a skip fails
pytest.importorskip("tokenizers")

SMALL = dict(context=48, vocab_size=300, max_bytes=40_000)
TEXT = (
    "task=causal_lm",
    "data=documents",
    "data.dataset.context=48",
    "data.dataset.vocab_size=300",
    "model=gpt",
)

register_schema()


@pytest.fixture(scope="module")
def corpus():
    """The standard library's first documents, padded and packed alike, and their tokenizer."""
    return text.documents(**SMALL), text.documents(packing=True, **SMALL)


def test_the_tokenizer_is_the_same_from_the_same_text_and_loads_in_transformers(tmp_path):
    documents = text.python_documents(40_000)
    one, two = text.train_tokenizer(documents, 300), text.train_tokenizer(documents, 300)
    assert one.to_str() == two.to_str() and one.get_vocab_size() == 300
    assert text.special_ids(one) == (0, 1)  # end of text, padding
    folder = text.save_tokenizer(one, tmp_path / "tokenizer", context=48)
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(folder)
    sample = documents[3]
    assert loaded(sample)["input_ids"] == one.encode(sample).ids
    assert loaded.decode(one.encode(sample).ids) == sample  # byte-level: every byte round-trips
    assert (loaded.eos_token_id, loaded.pad_token_id) == (0, 1)
    assert json.loads((folder / "tokenizer_config.json").read_text())["model_max_length"] == 48


def test_documents_are_cut_into_pieces_no_longer_than_the_context_and_end_with_end_of_text(corpus):
    (padded, _), _ = corpus
    assert padded.lengths.max() <= SMALL["context"] and padded.lengths.min() >= 1
    assert len(set(padded.lengths.tolist())) > 10  # documents of many lengths
    ends = [
        padded[i]["input_ids"][-1].item()
        for i in range(len(padded))
        if padded.lengths[i] < SMALL["context"]
    ]
    # a piece shorter than the context is a document's end
    assert ends and all(end == 0 for end in ends)


def test_a_padded_batch_is_padded_on_the_right_to_its_longest_and_its_padding_counts_in_no_loss():
    collate = text.PadCollate(pad_id=1)
    batch = collate([{"input_ids": torch.tensor([5, 6, 7])}, {"input_ids": torch.tensor([8])}])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 1, 1]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[5, 6, 7], [8, -100, -100]]
    # 6 and 7 predicted; the second row's first token starts it
    assert CausalLM().units(batch).item() == 2


def test_best_fit_decreasing_lays_every_piece_once_whole_and_fills_windows_tightly():
    lengths = torch.randint(1, 49, (500,), generator=torch.Generator().manual_seed(0)).tolist()
    windows = text.pack(lengths, 48)
    assert sorted(i for window in windows for i in window) == list(range(500))
    assert all(sum(lengths[i] for i in window) <= 48 for window in windows)
    assert len(windows) <= sum(lengths) / 48 * 1.05  # within 5 % of no padding at all (3 % here)
    # the same rule, written plainly: each piece, longest first, where it leaves least room
    best_fit = []
    for i in sorted(range(500), key=lambda i: (-lengths[i], i)):
        room = [(48 - used, b) for b, used in enumerate(best_fit) if 48 - used >= lengths[i]]
        if room:
            best_fit[min(room)[1]] += lengths[i]
        else:
            best_fit.append(lengths[i])
    assert len(windows) == len(best_fit)
    assert text.pack(lengths, 48) == windows  # a function of the lengths alone


def test_packed_windows_restart_positions_and_predict_no_token_across_documents(corpus):
    (padded, _), (packed, _) = corpus
    tree = packed.tree
    ids, labels, positions = tree["input_ids"], tree["labels"], tree["position_ids"]
    assert ids.shape[1] == labels.shape[1] == positions.shape[1] == SMALL["context"]
    starts = positions == 0
    assert (labels[starts] == -100).all()  # no document's first token is predicted from another's
    # The same tokens are counted packed and padded: each piece's all but its first.
    assert CausalLM().units(tree) == (padded.lengths - 1).sum()
    assert (ids == 1).float().mean() < 0.05  # little padding left


def test_a_packed_documents_losses_equal_it_run_alone_in_the_built_in_gpt():
    # In float64, where another order of the same sums moves a loss by about 1e-16: the packed row
    # differs from the documents run alone only in the shapes of its sums, not in what is attended.
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=300, context=48, dim=32, depth=2, heads=4).double()
    pieces = [
        torch.randint(2, 300, (n,), generator=torch.Generator().manual_seed(n))
        for n in (20, 11, 9, 5)
    ]
    window = text.packed(pieces, 48, pad_id=1)[slice(0, 1)]
    # all four in one window
    assert window["position_ids"][0, :21].tolist() == list(range(20)) + [0]
    together = _document_losses(model, window)
    alone = [
        _document_losses(model, text.packed([piece], 48, pad_id=1)[slice(0, 1)])[0]
        for piece in pieces
    ]
    gaps = [abs(a - b) / abs(b) for a, b in zip(together, alone)]
    assert len(together) == 4 and max(gaps) <= 1e-12, gaps  # FLOAT64_BOUND (tests/support.py)
    # Without its position ids the row is one sequence: the later documents see the earlier ones.
    blind = _document_losses(
        model, {**window, "position_ids": torch.arange(48)[None]}, window["position_ids"]
    )
    assert max(abs(a - b) / abs(b) for a, b in zip(blind[1:], alone[1:])) > 1e-3


def test_a_packed_documents_losses_equal_it_run_alone_in_a_transformers_llama():
    # transformers computes its norms and rotary angles in float32 even in a float64 model, so the
    # bound is this host's float32 noise: the same documents run alone at two batch shapes (alone,
    # and padded beside a longer one). Ceiling 1e-5: float32 noise of these sums is about 1e-7.
    pytest.importorskip("transformers")
    from hydra_ddp.hf import causal_lm

    torch.manual_seed(0)
    config = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    model = causal_lm(vocab_size=300, num_key_value_heads=4, max_position_embeddings=48, **config)
    pieces = [
        torch.randint(2, 300, (n,), generator=torch.Generator().manual_seed(n))
        for n in (20, 11, 9, 5)
    ]
    together = _document_losses(model, text.packed(pieces, 48, pad_id=1)[slice(0, 1)])
    alone = [
        _document_losses(model, text.packed([piece], 48, pad_id=1)[slice(0, 1)])[0]
        for piece in pieces
    ]
    collate = text.PadCollate(pad_id=1)
    beside = [
        _padded_losses(model, collate([{"input_ids": piece}, {"input_ids": pieces[0].repeat(2)}]))[
            0
        ]
        for piece in pieces
    ]
    noise = max(abs(a - b) / abs(b) for a, b in zip(beside, alone))
    bound = 10 * noise + 1e-6
    assert bound <= 1e-5, (
        f"this host's float32 noise gives a bound of {bound:.1e}, over the ceiling 1e-5"
    )
    gaps = [abs(a - b) / abs(b) for a, b in zip(together, alone)]
    assert max(gaps) <= bound, (gaps, noise)
    # The control: with positions 0 … 47 the row is one sequence, and the later documents attend to
    # the earlier ones (llm-foundry #1464): their losses move far beyond that bound.
    window = text.packed(pieces, 48, pad_id=1)[slice(0, 1)]
    blind = _document_losses(
        model, {**window, "position_ids": torch.arange(48)[None]}, window["position_ids"]
    )
    assert max(abs(a - b) / abs(b) for a, b in zip(blind[1:], alone[1:])) > 100 * bound
    # it reads position_ids
    assert packing_warning(CausalLM(), model, text.packed(pieces, 48, pad_id=1)) is None


def test_a_model_that_attends_across_packed_documents_is_named_in_one_line():
    class Blind(TinyGPT):
        def forward(self, x=None, input_ids=None, position_ids=None, attention_mask=None):
            # the position ids ignored: one sequence per row
            return super().forward(input_ids=input_ids)

    torch.manual_seed(0)
    pieces = [
        torch.randint(2, 300, (n,), generator=torch.Generator().manual_seed(n)) for n in (20, 11)
    ]
    window = text.packed(pieces, 48, 1)
    shape = dict(vocab_size=300, context=48, dim=32, depth=1, heads=4)
    warning = packing_warning(CausalLM(), Blind(**shape), window)
    assert (
        warning
        and "attends across the documents packed into a window" in warning
        and "\n" not in warning
    )
    assert packing_warning(CausalLM(), TinyGPT(**shape), window) is None


def test_the_same_document_mask_is_causal_within_each_document():
    mask = same_document_causal_mask(torch.tensor([[0, 1, 2, 0, 1, 0]]))[0, 0]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [0, 0, 0, 1, 0, 0],
            [0, 0, 0, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_grouping_by_length_gives_each_step_the_same_samples_at_any_world_size(world: int):
    lengths = torch.randint(1, 200, (203,), generator=torch.Generator().manual_seed(1))
    dataset = list(range(203))
    step = 16  # samples per optimizer step, over all ranks

    def steps(ranks: int) -> list[list[int]]:
        per_rank = []
        for rank in range(ranks):
            sampler = sampling.ResumableDistributedSampler(
                dataset,
                num_replicas=ranks,
                rank=rank,
                shuffle=True,
                seed=3,
                by_length=(lengths, step, 4),
            )
            sampler.set_epoch(2)
            per_rank.append(list(sampler))
        # positions r, r+W, …
        everyone = [index for position in zip(*per_rank) for index in position]
        return [sorted(everyone[s : s + step]) for s in range(0, 192, step)]

    assert steps(world) == steps(1)
    first = steps(1)
    spread = [lengths[s].max() - lengths[s].min() for s in map(torch.tensor, first)]
    unsorted = lengths[:192].view(-1, step)
    # similar lengths per step
    assert sum(spread) < 0.5 * (unsorted.max(1).values - unsorted.min(1).values).sum()


def test_grouping_by_length_is_a_seeded_permutation_of_the_epoch():
    lengths = torch.randint(1, 200, (100,), generator=torch.Generator().manual_seed(1))
    order = torch.randperm(100, generator=torch.Generator().manual_seed(0))
    grouped = sampling.grouped_by_length(order, lengths, 8, 3, seed=0, epoch=1)
    assert sorted(grouped.tolist()) == list(range(100))
    assert torch.equal(grouped, sampling.grouped_by_length(order, lengths, 8, 3, seed=0, epoch=1))
    assert not torch.equal(
        grouped, sampling.grouped_by_length(order, lengths, 8, 3, seed=0, epoch=2)
    )


def test_a_language_models_loss_sum_counts_only_the_tokens_not_ignored():
    # (batch, vocab, time)
    logits = torch.randn(2, 7, 5, generator=torch.Generator().manual_seed(0))
    target = torch.randint(0, 7, (2, 5), generator=torch.Generator().manual_seed(1))
    target[1, 2:] = -100
    task = LanguageModel()
    assert task.units((None, target)).item() == 7
    assert task.loss_sum(logits, target) / 7 == pytest.approx(
        task.loss(logits, target).item(), rel=1e-6
    )
    assert task.state(logits, target)[2].item() == 7  # the evaluation counts the same tokens
    empty = torch.full((2, 5), -100)
    assert task.loss_sum(logits, empty).item() == 0.0  # no counted token: nothing, and no nan


def _document_losses(model, window: dict, positions=None) -> list[float]:
    """Per document of one packed row (its documents as `positions` mark them, else as the row's
    own): the sum of its token losses (float64)."""
    task = CausalLM()
    output, labels = task.forward(model, window)
    losses, _, counted = task._token_losses(output, labels)
    positions = (window["position_ids"] if positions is None else positions)[0]
    bounds = [*(positions == 0).nonzero()[:, 0].tolist(), len(positions)]
    sums = []
    for start, end in zip(bounds, bounds[1:]):
        if counted[0, start:end].any():
            sums.append(losses[0, start:end].double().sum().item())
    return sums


def _padded_losses(model, batch: dict) -> list[float]:
    task = CausalLM()
    output, labels = task.forward(model, batch)
    losses, _, _ = task._token_losses(output, labels)
    return losses.double().sum(1).tolist()


@pytest.mark.parametrize(
    "overrides, line",
    [
        (
            ("data.dataset.context=64", "model=hf_llama", "model.max_position_embeddings=48"),
            "has 48 positions",
        ),
        (("model.vocab_size=100",), "the model's embedding has 100 rows"),
        (("data.num_classes=100",), "the tokenizer makes 300 ids, and data.num_classes=100"),
        (
            ("model.dim=30",),
            "does not build: ValueError: TinyGPT: dim (30) must be a multiple of heads (4)",
        ),
        (
            ("model=hf_llama", "model.num_attention_heads=5"),
            "not a multiple of the number of attention heads (5)",
        ),
        (
            ("model=hf_llama", "model.architecture=no-such-model"),
            "model.architecture='no-such-model'",
        ),
        (("data.dataset.packing=true", "data.group_by_length=4"), "packed windows are one length"),
        (("data.even_shards=false",), "does not combine with task CausalLM"),
        (
            ("data.global_batch_size=30", "data.batch_size=8"),
            "does not divide into micro-batches of data.batch_size=8",
        ),
        (
            ("data.dataset._target_=recording.Stream",),
            "gives a stream (Stream, an IterableDataset)",
        ),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, tuple) else "",
)
def test_text_that_does_not_fit_the_model_is_one_line_before_launch(
    tmp_path, monkeypatch, overrides, line: str
):
    from support import HELPERS

    monkeypatch.syspath_prepend(str(HELPERS))  # recording.Stream
    with pytest.raises(UserError) as error:
        resolved(tmp_path, *TEXT, *overrides, "trainer.nproc=2")
    assert line in str(error.value) and "\n" not in str(error.value)
    # a group named once, and our own errors without their class name
    assert "model=model=" not in str(error.value) and "UserError" not in str(error.value)


def test_padded_documents_may_be_grouped_by_length_before_launch(tmp_path):
    # Their lengths vary (packed windows' do not): the pre-launch check lets the grouping through.
    cfg = resolved(
        tmp_path, *TEXT, "data.dataset.packing=false", "data.group_by_length=8", "trainer.nproc=2"
    )
    assert cfg.data.group_by_length == 8


def test_the_text_share_of_padded_batches_counts_each_batch_padded_to_its_longest():
    from hydra_ddp.data.about import line, text_share

    # batches (3, 1) and (2, 2): 4 of 6 places, then 4 of 4
    assert text_share(torch.tensor([3, 1, 2, 2]), 2) == 8 / 10
    assert text_share(torch.tensor([5]), 4) == 1.0
    assert text_share(torch.tensor([], dtype=torch.int64), 4) == 1.0
    assert line(
        {"files": 3, "documents": 1200, "tokens": 45678, "windows": 400, "text_share": 0.5}
    ) == (
        "data: 3 file(s), 1,200 documents, 45,678 tokens in the training split; "
        "packed into 400 windows: 50.0 % text"
    )
