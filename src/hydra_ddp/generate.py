"""Sample text from a trained causal language model: the built-in GPT (model=gpt) or a Hugging Face
`transformers` model (model=hf_llama), from a run directory or a checkpoint, on the CPU.

    hydra-ddp generate ckpt=RUN_DIR prompt="Once upon" max_new_tokens=40
    hydra-ddp generate ckpt=RUN_DIR prompt="Once upon" temperature=0.8 top_k=50 seed=1

Greedy by default (temperature=0: the likeliest next token each time); temperature > 0 samples from
the softmax of the logits divided by it, over the top_k likeliest tokens (0: all), from a generator
seeded with `seed`. Stops at the run's end-of-text token or after max_new_tokens. The run's own
tokenizer encodes the prompt and decodes the text (the one it trained and saved, or made again from
its data); the weights are those the run tested (their moving average, with trainer.ema). A model
with a key/value cache (transformers') reuses it for each new token; the built-in GPT runs the
window of its last `context` tokens again. From Python:

    from hydra_ddp.generate import generate
    text = generate("outputs/runs/DATE/TIME", "Once upon", max_new_tokens=40)
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # torch is imported when the model is, not with this module
    from torch import nn

KEYS = ("ckpt", "prompt", "max_new_tokens", "temperature", "top_k", "seed")


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 50
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: every token
    seed: int = 0


def load(ckpt: str) -> tuple[Any, Any, int, Optional[int]]:
    """(model in eval mode on the CPU with the run's tested weights, tokenizer, end-of-text id, the
    model's context or None)."""
    from hydra.utils import instantiate

    from hydra_ddp.checkpoint import files as checkpoints
    from hydra_ddp.config import run_config
    from hydra_ddp.data import text
    from hydra_ddp.errors import UserError

    path = checkpoints.find(ckpt, "ckpt")
    state = checkpoints.read(path, "ckpt")
    config = run_config.typed(state["config"])
    dataset = config.data.dataset
    saved = path.parent.parent / "tokenizer" if path.parent.name == "checkpoints" else None
    if saved is not None and (saved / text.TOKENIZER_FILE).is_file():
        tokenizer = text.load_tokenizer(str(saved))
    elif str(dataset.get("_target_", "")).endswith(".documents"):
        tokenizer = text.run_tokenizer(dataset)
    else:
        raise UserError(
            f"ckpt={ckpt}: generate samples from a language model trained on tokenized text "
            f"(data=documents, or a run that saved its tokenizer), and this run's data is "
            f"{dataset.get('_target_')}"
        )
    end, _ = text.special_ids(tokenizer)
    model = instantiate(config.model)
    model.load_state_dict(checkpoints.model_weights(path, state))
    model.eval()
    return model, tokenizer, end, getattr(model, "context", None)


def generate(ckpt: str, prompt: str, **sampling: Any) -> str:
    """The prompt's continuation (the new text alone), as `hydra-ddp generate` prints it."""
    model, tokenizer, end, context = load(ckpt)
    prompt_ids = tokenizer.encode(prompt).ids
    new = sample(model, prompt_ids, end, context, Sampling(**sampling))
    return tokenizer.decode(new)


def sample(
    model: nn.Module, prompt_ids: list[int], end: int, context: Optional[int], how: Sampling
) -> list[int]:
    """The new token ids after `prompt_ids`, up to and without `end`."""
    import torch

    from hydra_ddp.errors import UserError

    if not prompt_ids:
        raise UserError("prompt= is empty: give the text to continue")
    generator = torch.Generator().manual_seed(how.seed)
    ids = torch.tensor([prompt_ids])
    cache, new = None, []
    uses_cache = hasattr(getattr(model, "config", None), "use_cache")  # transformers' models
    with torch.no_grad():
        for _ in range(how.max_new_tokens):
            if uses_cache:
                step_ids = ids if cache is None else ids[:, -1:]
                out = model(input_ids=step_ids, past_key_values=cache, use_cache=True)
                cache, logits = out.past_key_values, out.logits[0, -1]
            else:
                window = ids if context is None else ids[:, -context:]
                logits = model(input_ids=window).logits[0, -1]
            token = _choose(logits.float(), how, generator)
            if token == end:
                break
            new.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return new


def _choose(logits: Any, how: Sampling, generator: Any) -> int:
    import torch

    if how.temperature == 0:
        return int(torch.argmax(logits))
    logits = logits / how.temperature
    if how.top_k:
        kept, _ = torch.topk(logits, min(how.top_k, logits.numel()))
        logits = torch.where(logits < kept[-1], torch.full_like(logits, -float("inf")), logits)
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))


def _arguments(argv: list[str]) -> tuple[str, str, Sampling]:
    from hydra_ddp.errors import UserError

    given: dict[str, str] = {}
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key not in KEYS:
            raise UserError(
                f"{arg!r}: give ckpt=PATH prompt=TEXT, and optionally max_new_tokens=N, "
                "temperature=T (0: greedy), top_k=K, seed=S"
            )
        given[key] = value
    for needed in ("ckpt", "prompt"):
        if needed not in given:
            raise UserError(f"{needed}= is missing: hydra-ddp generate ckpt=RUN_DIR prompt=TEXT")
    try:
        how = Sampling(
            max_new_tokens=int(given.get("max_new_tokens", Sampling.max_new_tokens)),
            temperature=float(given.get("temperature", Sampling.temperature)),
            top_k=int(given.get("top_k", Sampling.top_k)),
            seed=int(given.get("seed", Sampling.seed)),
        )
    except ValueError as error:
        raise UserError(f"{error}: max_new_tokens, top_k and seed are integers") from None
    if how.max_new_tokens < 1 or how.temperature < 0 or how.top_k < 0:
        raise UserError("max_new_tokens ≥ 1, temperature ≥ 0 (0: greedy) and top_k ≥ 0 (0: all)")
    return given["ckpt"], given["prompt"], how


def main(argv: list[str]) -> int:
    from hydra_ddp.errors import UserError

    try:
        ckpt, prompt, how = _arguments(argv)
        model, tokenizer, end, context = load(ckpt)
        prompt_ids = tokenizer.encode(prompt).ids
        new = sample(model, prompt_ids, end, context, how)
    except UserError as error:
        print(f"hydra-ddp: error: {error}", file=sys.stderr)
        return error.exit_code
    print(tokenizer.decode(prompt_ids + new))  # the prompt and its continuation, as one text
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
