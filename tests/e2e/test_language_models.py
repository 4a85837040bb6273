"""Language models on text as it comes (data=documents: documents of different lengths, padded or
packed), trained exactly: one global batch trains alike however it is split over ranks and
micro-batches (the loss weighs every token of the step alike); a packed run stopped mid-epoch
resumes bit for bit; evaluation is bit-equal at 1, 2 and 3 ranks, padded or packed; the summary says
what a step holds."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from support import (
    FLOAT64_BOUND,
    ONCE,
    REPO,
    assert_same_run,
    assert_within_float_noise,
    check_ok,
    csv_losses,
    finish,
    run_eval,
    run_export,
    run_train,
    start_train,
    summary,
    train_env,
    wait_for,
)

# the transformers extra: .ci/run installs it; under CI=true a skip fails
pytest.importorskip("tokenizers")

# Small documents (the standard library's first files, pieces of at most 48 tokens), a small GPT.
TEXT = (
    "task=causal_lm",
    "data=documents",
    "data.dataset.context=48",
    "data.dataset.vocab_size=300",
    "data.dataset.max_bytes=60000",
    "model=gpt",
    "model.dim=32",
    "model.depth=1",
    "model.heads=4",
    "trainer.log_every=1",
)
# In float64 (tests/helpers/probes.py), where summing in another order moves a loss by about 1e-16
# and a per-micro-batch mean moves it by 1e-3: the two are told apart by far.
FLOAT64 = ("model._target_=probes.float64", "+model.of=hydra_ddp.models.TinyGPT")
STEPS = 8
METRICS = ("test_loss", "test_accuracy", "test_perplexity", "test_samples")


def _trained(run_dir: Path, *overrides: str) -> list[float]:
    """A run's losses, every step's and the test's after the last (float64's digits)."""
    check_ok(
        run_train(
            run_dir, *TEXT, *FLOAT64, f"trainer.max_steps={STEPS}", "trainer.threads=1", *overrides
        )
    )
    return csv_losses(run_dir) + [summary(run_dir)["test_loss"]]


@pytest.mark.timeout(400)
def test_one_global_batch_of_padded_documents_trains_alike_however_it_is_split(tmp_path: Path):
    # 16 documents a step, right-padded to each batch's longest (labels -100 on the padding): one
    # rank of 16, two ranks of 8, one rank of 8 accumulated twice. Every token of the step weighs
    # alike in all three; only the order of the sums differs.
    whole = _trained(
        tmp_path / "1x16", "trainer.nproc=1", "data.global_batch_size=16", "data.batch_size=16"
    )
    ranks = _trained(
        tmp_path / "2x8", "trainer.nproc=2", "data.global_batch_size=16", "data.batch_size=8"
    )
    accumulated = _trained(
        tmp_path / "1x8x2", "trainer.nproc=1", "data.global_batch_size=16", "data.batch_size=8"
    )
    assert (
        summary(tmp_path / "1x8x2")["accumulate"] == 2
        and summary(tmp_path / "2x8")["accumulate"] == 1
    )
    # The bound, on this host: the same run with its sums in another order (two threads, not one).
    noise = _trained(
        tmp_path / "noise", "trainer.nproc=1", "data.global_batch_size=16", "trainer.threads=2"
    )
    # float64's order noise over 8 steps: a few units of 2.2e-16
    ceiling, floor = FLOAT64_BOUND, 1e-14
    assert_within_float_noise(ranks, whole, noise, ceiling=ceiling, floor=floor)
    assert_within_float_noise(accumulated, whole, noise, ceiling=ceiling, floor=floor)
    # The weighting this replaced, each micro-batch's mean loss and each rank's alike (a task that
    # weighs samples), fails the same bound by orders of magnitude: 2 ranks of 8 are not 1 of 16.
    mean_per_batch = "task._target_=per_batch.MeanPerBatch"
    old = _trained(tmp_path / "old", "trainer.nproc=2", "data.global_batch_size=16", mean_per_batch)
    with pytest.raises(AssertionError, match="gap beyond"):
        assert_within_float_noise(old, whole, noise, ceiling=ceiling, floor=floor)
    assert max(abs(a - b) / b for a, b in zip(old, whole)) > 1e-4
    # and 1 rank of 8 accumulated twice (transformers #34191): the micro-batches' means averaged
    old_accumulated = _trained(
        tmp_path / "old1x8x2",
        "trainer.nproc=1",
        "data.global_batch_size=16",
        "data.batch_size=8",
        mean_per_batch,
    )
    with pytest.raises(AssertionError, match="gap beyond"):
        assert_within_float_noise(old_accumulated, whole, noise, ceiling=ceiling, floor=floor)


@pytest.mark.timeout(500)
@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_a_run_stopped_mid_epoch_resumes_bit_identical_and_evaluates_alike_at_1_2_3_ranks(
    tmp_path: Path, packing: bool
):
    common = (
        *TEXT,
        f"data.dataset.packing={packing}",
        "data.global_batch_size=16",
        "trainer.max_steps=12",
    )
    straight = tmp_path / "straight"
    check_ok(run_train(straight, *common))
    s = summary(straight)
    assert (
        s["world_size"],
        s["steps"],
        s["batch_size"],
        s["accumulate"],
        s["global_batch_size"],
    ) == (2, 12, 8, 1, 16)
    assert s["tokens_per_step"] > 0 and s["tokens_per_sec"] > 0 and s["flops"]["mfu"] is not None
    assert (straight / "tokenizer" / "tokenizer.json").is_file()  # as transformers loads it
    # What it read, in its first lines and its summary: the standard library's documents, their
    # tokens, and how much of the batches (packed windows of 48; padded batches of 8) is text.
    read = s["data"]
    assert read["files"] is None and 0 < read["documents"] < read["tokens"], read
    if packing:
        assert read["text_share"] == read["tokens"] / (read["windows"] * 48), read
        how = f"packed into {read['windows']:,} windows: {100 * read['text_share']:.1f} % text"
    else:
        assert "windows" not in read and 0 < read["text_share"] < 1, read
        how = f"padded per batch: {100 * read['text_share']:.1f} % text in rank 0's first epoch"
    assert (
        f"data: Python's own source, {read['documents']:,} documents, {read['tokens']:,} tokens "
        f"in the training split; {how}"
    ) in (straight / "train.log").read_text()
    if packing:
        _samples_from_the_run(straight)
    # SIGTERM at rank 0's 5th training forward, mid-epoch; resumed: every loss, metrics.csv and the
    # weights.
    stopped = tmp_path / "stopped"
    probe = (
        "model._target_=probes.signal_at",
        "+model.of=hydra_ddp.models.TinyGPT",
        "+model.step=5",
        ONCE,
    )
    done = finish(start_train(stopped, *common, *probe))
    assert done.returncode == 143, done.stderr
    assert 4 <= summary(stopped)["steps"] < 12
    check_ok(run_train(stopped, *common, "trainer.resume=auto"))
    assert_same_run(stopped, straight, "resumed after SIGTERM")
    assert {k: summary(stopped)[k] for k in METRICS} == {k: s[k] for k in METRICS}
    # eval.py on the run's checkpoint at 1, 2 and 3 ranks (3: the test split's chunks do not
    # divide), one sweep: the run's own test metrics, bit for bit, each time.
    evals = tmp_path / "evals"
    check_ok(
        run_eval(
            tmp_path / "unused",
            "-m",
            f"ckpt={straight}",
            "trainer.nproc=1,2,3",
            f"hydra.sweep.dir={evals}",
            timeout=300,
        )
    )
    for job, world in enumerate((1, 2, 3)):
        assert (
            f"trainer.nproc={world}" in (evals / str(job) / ".hydra" / "overrides.yaml").read_text()
        )
        result = json.loads((evals / str(job) / "eval.json").read_text())
        assert {k: result[k] for k in METRICS} == {k: s[k] for k in METRICS}, world


def test_a_causal_lm_given_pairs_and_a_stream_are_each_one_line(tmp_path: Path):
    # the digits' (image, label)
    proc = run_train(tmp_path / "pairs", "task=causal_lm", "trainer.max_steps=2")
    errors = [text for text in proc.stderr.splitlines() if text.startswith("hydra-ddp: error:")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-2000:]
    assert (
        "task=causal_lm takes dict batches with input_ids "
        "and labels, and the data gives a list of 2" in errors[0]
    )
    # A source that returns a stream is found where it is built, in the workers: one line from every
    # rank.
    proc = run_train(
        tmp_path / "stream", "data.dataset._target_=recording.streamed", "trainer.max_steps=2"
    )
    errors = [text for text in proc.stderr.splitlines() if text.startswith("hydra-ddp: error:")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-2000:]
    assert (
        "data.dataset (recording.streamed) gives a stream (Stream, an IterableDataset)" in errors[0]
    )
    assert "python -m hydra_ddp.tools.shards write DIR --source recording.streamed" in errors[0]


@pytest.mark.timeout(400)
def test_a_run_continues_from_its_folder_alone_and_a_refused_continuation_leaves_its_record(
    tmp_path: Path,
):
    """README's resume line on an experiment's run: `hydra.run.dir=RUN trainer.resume=auto` alone
    continues the run's own config (its record's overrides), bit for bit as the run that was not
    stopped. A continuation refused (a new length under the experiment's warmup_cosine, which spans
    the run) is one line, and the run's record (.hydra/, metrics.csv, summary.json, the log) stays
    byte for byte as it was; a change given with the resume line applies, one log line per key."""
    small = (
        "+experiment=documents_gpt",
        "data.dataset.context=48",
        "data.dataset.vocab_size=300",
        "data.dataset.max_bytes=60000",
        "model.dim=32",
        "model.depth=1",
        "trainer.max_steps=12",
        "trainer.log_every=1",
        "checkpoint.every_n_steps=2",
    )
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    check_ok(run_train(straight, *small))
    proc = start_train(stopped, *small)
    wait_for(lambda: (stopped / "checkpoints" / "step-00000004.pt").exists(), 120, "step 4", proc)
    proc.send_signal(signal.SIGTERM)
    done = finish(proc)
    assert done.returncode == 143, done.stderr
    assert summary(stopped)["steps"] < 12

    def record() -> dict[str, bytes]:
        files = [*sorted((stopped / ".hydra").iterdir()), stopped / "metrics.csv"]
        files += [stopped / "summary.json", stopped / "train.log"]
        return {path.name: path.read_bytes() for path in files}

    kept = record()
    refused = run_train(stopped, "trainer.resume=auto", "trainer.max_steps=14")
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode != 0 and len(lines) == 1, refused.stderr
    assert lines[0].startswith(
        "hydra-ddp: error: trainer.max_steps: 12 → 14 on resume: the schedule (warmup_cosine) "
        "spans the run's whole length"
    ), lines[0]
    assert record() == kept
    # the resume line alone: the run's own config, to the end, bit for bit the straight run's
    check_ok(run_train(stopped, "trainer.resume=auto"))
    assert_same_run(stopped, straight, "continued from its folder alone")
    assert "differs from the checkpoint's" not in (stopped / "train.log").read_text()
    # a change given with it applies, said in one line of its own
    check_ok(run_train(stopped, "trainer.resume=auto", "trainer.log_every=3"))
    changes = [
        line
        for line in (stopped / "train.log").read_text().splitlines()
        if "differs from the checkpoint's" in line
    ]
    assert len(changes) == 1 and "trainer.log_every: 1 → 3" in changes[0], changes


@pytest.mark.cold  # tokenizers is hidden from this command's own process (a fork has its own)
def test_text_that_cannot_be_read_is_one_line_before_any_run_directory(tmp_path: Path):
    """A glob of text files that matches none, a folder given for the glob, and tokenizers not
    installed: refused before launch, in one line each, with no run directory left behind."""
    import subprocess
    import sys

    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("a document\n")
    cases = {
        f"data.dataset.files={tmp_path / 'corpus' / '*.md'}": "matches no file; give a glob",
        f"data.dataset.files={tmp_path / 'corpus'}": (
            f"is a folder; give a glob of its text files: data.dataset.files="
            f"'{tmp_path / 'corpus'}/**/*.txt'"
        ),
    }
    for index, (files, says) in enumerate(cases.items()):
        run_dir = tmp_path / f"run{index}"
        proc = run_train(run_dir, *TEXT, files, "trainer.max_steps=2")
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode != 0 and len(lines) == 1 and says in lines[0], proc.stderr
        assert lines[0].startswith("hydra-ddp: error: data.dataset.files=")
        assert not run_dir.exists()
    # As if the package were not installed (None in sys.modules: Python's mark for a module that
    # must not be imported).
    run_dir = tmp_path / "no-tokenizers"
    code = (
        "import runpy, sys; sys.modules['tokenizers'] = None; "
        f"sys.argv = ['train.py', *{list(TEXT)!r}, 'hydra.run.dir={run_dir}']; "
        "runpy.run_path('train.py', run_name='__main__')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(
        "hydra-ddp: error: data=documents needs Hugging Face tokenizers (tokenizers), which is "
        "not installed: pip install tokenizers"
    ), lines[0]
    assert not run_dir.exists()


def _samples_from_the_run(run_dir: Path) -> None:
    """`hydra-ddp generate` on the built-in GPT's run: the prompt, then its continuation, the same
    each time for one seed (greedy, or sampled from the top 5 at temperature 1); in Python, the
    same tokens."""
    import subprocess
    import sys

    from hydra_ddp import generate

    def command(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                str(Path(sys.executable).with_name("hydra-ddp")),
                "generate",
                f"ckpt={run_dir}",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )

    greedy = command("prompt=import os", "max_new_tokens=12")
    assert greedy.returncode == 0, greedy.stderr
    model, tokenizer, end, context = generate.load(str(run_dir))
    prompt_ids = tokenizer.encode("import os").ids
    new = generate.sample(model, prompt_ids, end, context, generate.Sampling(max_new_tokens=12))
    assert greedy.stdout == tokenizer.decode(prompt_ids + new) + "\n"
    assert greedy.stdout.startswith("import os") and len(new) <= 12 and end not in new
    sampled = ("prompt=import os", "max_new_tokens=12", "temperature=1.0", "top_k=5", "seed=3")
    assert command(*sampled).stdout == command(*sampled).stdout
    wrong = command()
    assert wrong.returncode != 0 and wrong.stderr.strip() == (
        "hydra-ddp: error: prompt= is missing: hydra-ddp generate ckpt=RUN_DIR prompt=TEXT"
    )
    # The weights alone (format=safetensors, what the hf export's refusal names for this model):
    # its yaml holds the model's own keys, none of an image model's.
    out = run_dir.parent / "exported" / "model.safetensors"
    exported = run_export(f"ckpt={run_dir}", f"out={out}")
    assert exported.returncode == 0, exported.stderr
    import yaml

    described = yaml.safe_load(out.with_name("model.yaml").read_text())
    assert described["model"]["_target_"] == "hydra_ddp.models.TinyGPT"
    assert not {"in_channels", "image_size"} & set(described["model"]), described["model"]
