"""Export a checkpoint's model for use elsewhere: its plain state dict (safetensors or torch) and
the model's config beside it, loadable without this project.

    python -m hydra_ddp.export ckpt=RUN_DIR_OR_CHECKPOINT [format=safetensors|torch|hf] [out=PATH]

out: by default export/model.safetensors (model.pt, model-hf/) in the checkpoint's run directory.

ckpt: a run directory (its best checkpoint, else its last), a checkpoint file (ddp) or a sharded
checkpoint's directory (fsdp, tp, fsdp_tp: read with DCP in this one process). The weights are
the full model's as the run evaluated them (their moving average, for a run with trainer.ema),
on the CPU, under the model's own parameter names: no optimizer, no project
class, nothing but tensors. Beside them, OUT's stem + ".yaml" holds the model's config (its
`_target_` and arguments, as the run resolved them: the data's shape where the model takes it), so
that

    model = MyNet(**{k: v for k, v in config["model"].items() if k != "_target_"})
    model.load_state_dict(safetensors.torch.load_file("model.safetensors"))

rebuilds it anywhere the model's class is importable.

format=hf, for a Hugging Face `transformers` model (model=hf_llama, any `hydra_ddp.hf.causal_lm`):
OUT is a directory as `save_pretrained` writes it (config.json, model.safetensors), with the run's
tokenizer beside them where it has one (data=documents'), so that
`AutoModelForCausalLM.from_pretrained(OUT)` and `AutoTokenizer.from_pretrained(OUT)` load them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

FORMATS = {"safetensors": ".safetensors", "torch": ".pt", "hf": ""}  # hf: a directory


def export(ckpt: str, out: Path, fmt: str) -> tuple[Path, Path]:
    """Write the weights and the config; their paths."""
    import torch
    import yaml

    from hydra_ddp.checkpoint import files as checkpoints
    from hydra_ddp.config import run_config

    path = checkpoints.find(ckpt, "ckpt")
    state = checkpoints.read(path, "ckpt")
    # Contiguous copies of their own: safetensors refuses tensors that share memory (tied weights).
    weights = {
        name: tensor.detach().to("cpu").contiguous().clone()
        for name, tensor in checkpoints.model_weights(path, state).items()
    }
    which = "ema" if checkpoints.evaluated(state) == "ema" else "trained"  # the ones the run tested
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "hf":
        return _pretrained(path, state, weights, out)
    if fmt == "safetensors":
        from safetensors.torch import save_file

        metadata = {
            "checkpoint": str(path),
            "step": str(state["position"]["step"]),
            "weights": which,
        }
        save_file(weights, str(out), metadata=metadata)
    else:
        torch.save(weights, out)
    config = run_config.typed(state["config"])
    described = {
        "model": config.model,  # its own arguments: the data's shape where the model takes it
        "task": config.task,
        "checkpoint": str(path),
        "step": state["position"]["step"],
        "weights": which,  # ema: the moving average of the weights the run evaluated (trainer.ema)
        "format": fmt,
    }
    written = out.with_name(out.stem + ".yaml")
    written.write_text(
        "# The model's config for the weights beside this file (exported by hydra_ddp.export):\n"
        "# build model._target_ with the other model keys, then load_state_dict.\n"
        + yaml.safe_dump(described, sort_keys=False)
    )
    return out, written


def _pretrained(path: Path, state: dict, weights: dict, out: Path) -> tuple[Path, Path]:
    """A transformers model's weights as `save_pretrained` writes them, and the run's tokenizer
    beside them."""
    from hydra_ddp import hf
    from hydra_ddp.config import run_config
    from hydra_ddp.data import text
    from hydra_ddp.errors import UserError

    config = run_config.typed(state["config"])
    target = config.model["_target_"]
    if target != "hydra_ddp.hf.causal_lm":
        raise UserError(
            "format=hf is for Hugging Face transformers models "
            "(model=hf_llama: hydra_ddp.hf.causal_lm), and this "
            f"checkpoint's model is {target}: use format=safetensors for its weights; for a "
            "language model (the built-in GPT), hydra-ddp generate ckpt=RUN samples from it, "
            "and a run of model=hf_llama exports to transformers"
        )
    model = hf.causal_lm(**{key: value for key, value in config.model.items() if key != "_target_"})
    model.load_state_dict(weights)
    # the run's tokenizer: <run>/checkpoints/<checkpoint>, <run>/tokenizer; or made again
    saved, tokenizer, context = path.parent.parent / "tokenizer", None, None
    if (saved / text.TOKENIZER_FILE).is_file():
        tokenizer = text.load_tokenizer(str(saved))
    elif str(config.data.dataset.get("_target_", "")).endswith(".documents"):
        tokenizer = text.run_tokenizer(config.data.dataset)
        context = config.data.dataset.get("context")
    # trained without a key/value cache (hf.causal_lm): generate() wants it
    model.config.use_cache = True
    if tokenizer is not None:
        # the run's special tokens, not transformers' defaults (bos 1, eos 2): a document is its
        # tokens then end-of-text (no token starts one), a batch is padded with <pad>
        end, pad = text.special_ids(tokenizer)
        for hf in (model.config, model.generation_config):
            hf.bos_token_id, hf.eos_token_id, hf.pad_token_id = end, end, pad
        model.generation_config.use_cache = True
        text.save_tokenizer(tokenizer, out, context)
    model.save_pretrained(out)
    return out, out / "config.json"


def _arguments(argv: list[str]) -> dict[str, str]:
    from hydra_ddp.errors import UserError

    given: dict[str, str] = {}
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key not in ("ckpt", "format", "out"):
            raise UserError(
                f"{arg!r}: give ckpt=PATH, and optionally format=safetensors|torch|hf and out=PATH"
            )
        given[key] = value
    if "ckpt" not in given:
        raise UserError(
            "ckpt=PATH is missing: a run directory, a "
            "checkpoint file or a sharded checkpoint's directory"
        )
    fmt = given.get("format") or (
        "torch" if given.get("out", "").endswith((".pt", ".pth")) else "safetensors"
    )
    if fmt not in FORMATS:
        raise UserError(f"format={fmt!r}: choose {' or '.join(FORMATS)}")
    given["format"] = fmt
    return given


def default_out(ckpt: Any, fmt: str) -> Path:
    """Where an export goes unless out= says: export/ in the checkpoint's run directory (beside the
    run's other outputs, not wherever the command was typed), model.safetensors, model.pt or
    model-hf/; of a checkpoint in object storage, export/ here."""
    if not isinstance(ckpt, Path):
        run = Path.cwd()
    else:
        run = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent
    return run / "export" / ("model-hf" if fmt == "hf" else f"model{FORMATS[fmt]}")


def main(argv: list[str]) -> int:
    from hydra_ddp.errors import UserError

    try:
        args = _arguments(argv)
        if "out" in args:
            out = Path(args["out"]).expanduser().resolve()
        else:
            from hydra_ddp.checkpoint import files as checkpoints

            out = default_out(checkpoints.find(args["ckpt"], "ckpt"), args["format"])
        weights, config = export(args["ckpt"], out, args["format"])
    except UserError as error:
        print(f"hydra-ddp: error: {error}", file=sys.stderr)
        return 2
    print(f"hydra-ddp: exported {weights} ({args['format']}) and {config}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
