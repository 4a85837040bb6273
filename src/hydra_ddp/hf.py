"""Hugging Face `transformers` models, built from their config classes (no download):
model=hf_llama. Kept out of models.py, which an export ships alone beside its weights (it imports
only torch)."""

from __future__ import annotations

from typing import Any

from torch import nn

from hydra_ddp.errors import UserError, first_line, install_line, root_cause


def causal_lm(
    architecture: str = "llama", attn_implementation: str = "sdpa", **config: Any
) -> nn.Module:
    """A Hugging Face `transformers` causal language model built from its config class, no download:
    `architecture` names the config (llama: LlamaConfig, gpt2: GPT2Config, ...; any of AutoConfig's
    model types) and `config` its fields. Its weights are initialised here, from torch's
    generator."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise UserError(
            "model=hf_llama needs Hugging Face transformers: "
            f"{install_line('transformers', 'transformers')}"
        ) from None
    # Training keeps no cache of past keys and values: it would cost memory every step, and with one
    # transformers does not read packed documents from restarting position ids (data=documents).
    config.setdefault("use_cache", False)
    try:
        settings = AutoConfig.for_model(architecture, **config)
    except Exception as error:  # noqa: BLE001  (an unknown architecture; fields its config refuses: heads ∤ width)
        raise UserError(
            f"model.architecture={architecture!r}: {first_line(root_cause(error))}"
        ) from None
    return AutoModelForCausalLM.from_config(settings, attn_implementation=attn_implementation)


causal_lm.requires = (  # type: ignore[attr-defined]
    ("transformers", "Hugging Face transformers", install_line("transformers", "transformers")),
)
