"""hydra_ddp.export: a run's model as a plain state dict (safetensors or torch) and its config,
loaded in a fresh process that never imports the project, giving the logits the project gives and
the predictions eval.py writes."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from support import QUICK, REPO, check_ok, documented, run_eval, run_export, run_train

# A fresh interpreter, isolated (-I: no PYTHONPATH, no user site), with the project made
# unimportable: it loads the model's class from its own file, the weights, and computes the batch's
# logits.
LOADER = """
import importlib.util, sys, torch, yaml
sys.modules["hydra_ddp"] = None  # any import of the project fails
models_file, config_file, weights_file, batch_file, out_file = sys.argv[1:]
spec = importlib.util.spec_from_file_location("models", models_file)
models = importlib.util.module_from_spec(spec)
spec.loader.exec_module(models)
config = yaml.safe_load(open(config_file))["model"]
cls = getattr(models, config.pop("_target_").rsplit(".", 1)[1])
model = cls(**config)
if weights_file.endswith(".safetensors"):
    from safetensors.torch import load_file
    weights = load_file(weights_file)
else:
    weights = torch.load(weights_file, weights_only=True)
model.load_state_dict(weights)
model.eval()
with torch.no_grad():
    torch.save(model(torch.load(batch_file, weights_only=True)), out_file)
"""


def _fresh_logits(tmp_path: Path, weights: Path, batch: torch.Tensor) -> torch.Tensor:
    torch.save(batch, tmp_path / "batch.pt")
    proc = subprocess.run(
        [
            sys.executable,
            "-I",
            "-c",
            LOADER,
            str(REPO / "src" / "hydra_ddp" / "models.py"),
            str(weights.with_name(weights.stem + ".yaml")),
            str(weights),
            str(tmp_path / "batch.pt"),
            str(tmp_path / "logits.pt"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return torch.load(tmp_path / "logits.pt", weights_only=True)


def _project_logits(ckpt: Path, batch: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The same weights through the project: the checkpoint's model, built from its config."""
    from hydra.utils import instantiate

    from hydra_ddp.checkpoint import files as checkpoints

    path = checkpoints.find(str(ckpt), "ckpt")
    state = checkpoints.read(path, "ckpt")
    model = instantiate(state["config"]["model"])
    model.load_state_dict(checkpoints.model_weights(path, state))
    model.eval()
    with torch.no_grad():
        return model(batch), state["config"]


def _host_noise(run_dir: Path, x: torch.Tensor, n: int, measure) -> float:
    """How far `measure` of the model's outputs on the first n samples moves on this host when only
    the batch (eval.py's size: all of x) and the memory format (channels_last, for images) change:
    eval.py computes its numbers so, and the kernels oneDNN picks for them differ by host. Four
    times that, and never under four float32 epsilons, bounds eval.py's numbers against ours."""
    alone, _ = _project_logits(run_dir, x[:n])
    in_batch, _ = _project_logits(
        run_dir, x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x
    )
    noise = (measure(alone) - measure(in_batch[:n])).abs().max().item()
    return max(4 * noise, 4 * torch.finfo(torch.float32).eps)


def _rounding(written: str) -> float:
    """Half a unit of the last digit predictions.csv wrote."""
    return (
        0.5 * 10.0 ** -len(written.partition(".")[2])
        if "." in written and "e" not in written.lower()
        else 0.0
    )


def _test_batch(config: dict, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The test split's first samples, in dataset order (eval.py's predictions.csv order)."""
    from omegaconf import OmegaConf

    from hydra_ddp import data
    from hydra_ddp.runtime.ranks import RankInfo

    test = data.build_datasets(
        OmegaConf.create(config["data"]), RankInfo(0, 1, 0, 1), config["trainer"]["seed"]
    )["test"]
    x, y = zip(*(test[i] for i in range(size)))
    return torch.stack(x), torch.stack([torch.as_tensor(t) for t in y])


def _predictions(eval_dir: Path) -> list[dict]:
    return list(csv.DictReader(open(eval_dir / "predictions.csv")))


def test_a_ddp_run_exports_weights_that_load_without_the_project(tmp_path: Path):
    run_dir = tmp_path / "run"
    check_ok(run_train(run_dir, *QUICK))
    evaluated = run_eval(
        tmp_path / "eval",
        *documented("docs/tasks.md", "eval.py ckpt=outputs/runs/DATE/TIME trainer.nproc=1"),
        f"ckpt={run_dir}",
    )
    check_ok(evaluated)
    assert (
        f"a row per test sample: {tmp_path / 'eval' / 'predictions.csv'}"
        in evaluated.stdout + evaluated.stderr
    )
    eval_batch = _test_batch_of(run_dir, None)[0]
    batch = eval_batch[:16]
    reference, _ = _project_logits(run_dir, batch)
    # Without out=: into the run's directory, not wherever the command was typed.
    proc = run_export(*documented("README.md", "hydra_ddp.export"), f"ckpt={run_dir}", cwd=tmp_path)
    assert proc.returncode == 0 and str(run_dir / "export" / "model.safetensors") in proc.stdout, (
        proc.stderr
    )
    assert (run_dir / "export" / "model.yaml").is_file() and not list(tmp_path.glob("model*"))
    for fmt, name in (("safetensors", "model.safetensors"), ("torch", "model.pt")):
        proc = run_export(
            f"ckpt={run_dir}", f"format={fmt}", f"out={tmp_path / fmt / name}", cwd=tmp_path
        )
        assert proc.returncode == 0 and proc.stdout.startswith("hydra-ddp: exported"), proc.stderr
        weights = tmp_path / fmt / name
        exported = yaml.safe_load(weights.with_name(weights.stem + ".yaml").read_text())
        assert (
            exported["model"]["_target_"] == "hydra_ddp.models.MnistCNN"
            and exported["format"] == fmt
        )
        fresh = _fresh_logits(tmp_path, weights, batch)
        assert torch.equal(fresh, reference)
    # As eval.py predicted on the same samples (it evaluates in the run's memory format: float
    # noise).
    rows = _predictions(tmp_path / "eval")[:16]
    probabilities = fresh.softmax(1)
    assert [int(r["predicted"]) for r in rows] == fresh.argmax(1).tolist()
    bound = _host_noise(run_dir, eval_batch, 16, lambda logits: logits.softmax(1).max(1).values)
    assert all(
        abs(float(r["probability"]) - p.item()) <= bound + _rounding(r["probability"])
        for r, p in zip(rows, probabilities.max(1).values)
    )


def _test_batch_of(run_dir: Path, size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The test split's first `size` samples (None: an eval.py batch's worth)."""
    from hydra_ddp.checkpoint import files as checkpoints

    path = checkpoints.find(str(run_dir), "ckpt")
    config = checkpoints.read(path, "ckpt")["config"]
    return _test_batch(config, size or config["data"]["eval_batch_size"])


@pytest.mark.timeout(300)
def test_a_sharded_fsdp_tp_checkpoint_exports_the_whole_model(tmp_path: Path):
    run_dir = tmp_path / "run"
    check_ok(
        run_train(
            run_dir,
            "+experiment=text_gpt",
            "strategy=fsdp_tp",
            "trainer.nproc=2",
            "strategy.tp_size=2",
            "trainer.max_steps=4",
            "model.depth=2",
        )
    )
    assert (run_dir / "checkpoints" / "best").is_dir()  # a sharded checkpoint (DCP)
    check_ok(run_eval(tmp_path / "eval", f"ckpt={run_dir}", "trainer.nproc=1", "predict=true"))
    weights = tmp_path / "gpt.pt"
    proc = run_export(f"ckpt={run_dir}", f"out={weights}", cwd=tmp_path)  # torch, from the suffix
    assert proc.returncode == 0, proc.stderr
    eval_x, eval_y = _test_batch_of(run_dir, None)
    x, y = eval_x[:8], eval_y[:8]
    reference, _ = _project_logits(run_dir, x)
    fresh = _fresh_logits(tmp_path, weights, x)
    assert torch.equal(fresh, reference)
    # eval.py's per-window predictions on the same windows: tokens predicted right, mean loss.
    rows = _predictions(tmp_path / "eval")[:8]
    correct = (fresh.argmax(1) == y).sum(1).tolist()
    losses = torch.nn.functional.cross_entropy(fresh, y, reduction="none").mean(1).tolist()
    assert [int(r["correct"]) for r in rows] == correct
    bound = _host_noise(
        run_dir,
        eval_x,
        8,
        lambda logits: torch.nn.functional.cross_entropy(logits, y, reduction="none").mean(1),
    )
    assert all(
        abs(float(r["loss"]) - loss) <= bound + _rounding(r["loss"])
        for r, loss in zip(rows, losses)
    )


@pytest.mark.parametrize(
    "args, message",
    [
        ((), "ckpt=PATH is missing"),
        (("ckpt=x", "format=onnx"), "format='onnx': choose safetensors or torch"),
        (("checkpoint=x",), "'checkpoint=x': give ckpt=PATH"),
        (("ckpt=/nowhere/at/all",), "ckpt"),
    ],
)
def test_bad_export_arguments_are_one_line(tmp_path: Path, args, message):
    proc = run_export(*args, cwd=tmp_path)
    assert (
        proc.returncode == 2
        and len(proc.stderr.strip().splitlines()) == 1
        and message in proc.stderr
    ), proc.stderr


# A small Llama on the tokenized documents (+experiment=documents_llama, cut down), for format=hf.
LLAMA = (
    "data.dataset.context=48",
    "data.dataset.vocab_size=300",
    "data.dataset.max_bytes=60000",
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_hidden_layers=2",
    "trainer.max_steps=3",
)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_transformers_model_exports_as_from_pretrained_loads_it_with_its_tokenizer(
    tmp_path: Path, strategy: str
):
    # The run's checkpoint (a file under ddp, DCP shards under fsdp) as save_pretrained writes it,
    # the run's tokenizer beside it: transformers' own loaders give the trained model's logits, bit
    # for bit.
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hydra_ddp.checkpoint import files
    from hydra_ddp.config import run_config
    from hydra_ddp.hf import causal_lm

    run_dir, out = tmp_path / "run", tmp_path / "hf"
    # docs/export.md's two commands, with the run's and the export's own folders
    train = documented("docs/export.md", "+experiment=documents_llama hydra.run.dir=outputs/llama")
    check_ok(run_train(run_dir, *train, *LLAMA, f"strategy={strategy}"))
    export = documented("docs/export.md", "ckpt=outputs/llama format=hf out=exported/llama")
    done = run_export(*export, f"ckpt={run_dir}", f"out={out}")
    assert done.returncode == 0, done.stderr
    assert (
        (out / "config.json").is_file()
        and (out / "model.safetensors").is_file()
        and (out / "tokenizer.json").is_file()
    )

    path = files.find(str(run_dir), "ckpt")
    state = files.read(path, "ckpt")
    config = run_config.typed(state["config"]).model
    trained = causal_lm(**{k: v for k, v in config.items() if k != "_target_"})
    trained.load_state_dict(files.model_weights(path, state))
    loaded, tokenizer = (
        AutoModelForCausalLM.from_pretrained(out),
        AutoTokenizer.from_pretrained(out),
    )
    ids = torch.tensor([tokenizer("def main(argv):\n    return 0\n")["input_ids"]])
    trained.eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, trained(input_ids=ids).logits)
    assert tokenizer.decode(ids[0]) == "def main(argv):\n    return 0\n"

    # The run's special tokens, not transformers' defaults: a text ends at <|endoftext|>, batches
    # pad with <pad>, and generate() stops there, with the key/value cache on.
    end, pad = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<pad>"])
    for settings in (loaded.config, loaded.generation_config):
        assert (settings.bos_token_id, settings.eos_token_id, settings.pad_token_id) == (
            end,
            end,
            pad,
        ), settings
    assert loaded.generation_config.use_cache and (
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    ) == (
        end,
        pad,
    )
    # hydra-ddp generate on the run (greedy, its own loop over the model's cache) writes the text
    # transformers' generate() makes from the export alone, to its end-of-text.
    prompt = "def main("
    prompt_ids = tokenizer(prompt)["input_ids"]
    with torch.no_grad():
        made = loaded.generate(torch.tensor([prompt_ids]), max_new_tokens=30, do_sample=False)[
            0, len(prompt_ids) :
        ].tolist()
    assert end not in made[:-1]  # stopped at its first end-of-text, if it made one
    new = made[:-1] if made[-1:] == [end] else made
    ours = subprocess.run(
        [
            str(Path(sys.executable).with_name("hydra-ddp")),
            "generate",
            f"ckpt={run_dir}",
            f"prompt={prompt}",
            "max_new_tokens=30",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ours.returncode == 0, ours.stderr
    assert ours.stdout == tokenizer.decode(prompt_ids + new) + "\n"


def test_format_hf_of_a_model_that_is_not_transformers_is_one_line(tmp_path: Path):
    run_dir = tmp_path / "run"
    check_ok(run_train(run_dir, *QUICK))
    done = run_export(f"ckpt={run_dir}", "format=hf", f"out={tmp_path / 'hf'}")
    assert (
        done.returncode == 2 and "format=hf is for Hugging Face transformers models" in done.stderr
    ), done.stderr
    # what to use instead: the weights alone, sampling from the run, a model transformers loads
    assert all(
        what in done.stderr
        for what in ("format=safetensors", "hydra-ddp generate ckpt=RUN", "model=hf_llama")
    ), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
