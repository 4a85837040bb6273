"""Models, built from conf/model/*.yaml through `_target_`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn


class MnistCNN(nn.Module):
    """The classic MNIST CNN of PyTorch's first examples (LeNet's shape): conv 1→20 k5, conv 20→50
    k5, fc 800→500, fc 500→10 (at 28×28)."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 20, 5)
        self.conv2 = nn.Conv2d(20, 50, 5)
        side = ((image_size - 4) // 2 - 4) // 2
        if side < 1:
            raise ValueError(f"MnistCNN needs image_size >= 16, got {image_size}")
        self.fc1 = nn.Linear(50 * side * side, 500)
        self.fc2 = nn.Linear(500, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return self.fc2(x)


class MLP(nn.Module):
    def __init__(self, in_features: int, num_classes: int = 10, hidden: Sequence[int] = (256, 128)):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class SegNet(nn.Module):
    """A small fully convolutional segmenter: 3×3 convolutions that keep the image's size, then a
    1×1 convolution to per-pixel class logits (batch, classes, H, W), for task=segmentation."""

    def __init__(self, in_channels: int = 1, num_classes: int = 3, width: int = 16, depth: int = 3):
        super().__init__()
        layers: list[nn.Module] = []
        channels = in_channels
        for _ in range(depth):
            layers += [nn.Conv2d(channels, width, 3, padding=1), nn.ReLU()]
            channels = width
        self.features = nn.Sequential(*layers)
        self.head = nn.Conv2d(channels, num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class _RepeatChannels(nn.Module):
    """Feeds grayscale images to a network that expects RGB."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.expand(-1, 3, -1, -1)


def torchvision_classifier(
    name: str, num_classes: int = 10, in_channels: int = 3, small_input: bool = False
) -> nn.Module:
    """Any torchvision classification model by name, randomly initialised (no weight download).

    `small_input` (ResNets): the CIFAR stem, a 3×3 stride-1 convolution and no max-pool, so 32×32
    images are not shrunk to 8×8 before the first block."""
    import torchvision  # imported here: it costs start-up time the default model does not need

    available = torchvision.models.list_models(module=torchvision.models)
    if name not in available:
        raise ValueError(
            f"unknown torchvision model {name!r}; choose one of: {', '.join(sorted(available))}"
        )
    model = torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    if small_input:
        if not (hasattr(model, "conv1") and hasattr(model, "maxpool")):
            raise ValueError(f"small_input applies to ResNets (conv1 and maxpool), not {name!r}")
        model.conv1 = nn.Conv2d(
            3, model.conv1.out_channels, kernel_size=3, stride=1, padding=1, bias=False
        )
        model.maxpool = nn.Identity()
    if in_channels == 1:
        return nn.Sequential(_RepeatChannels(), model)
    if in_channels != 3:
        raise ValueError(f"torchvision models take 1 or 3 input channels, got {in_channels}")
    return model


class LMOutput(NamedTuple):
    """What a causal language model called with `input_ids=` returns, as transformers' models do. A
    named tuple, not a dataclass: DDP finds the tensors of an output it can flatten (a tuple, a
    dict), and a static graph's first step needs to find them."""

    logits: torch.Tensor  # (batch, time, vocab)


class TinyGPT(nn.Module):
    """A small decoder-only transformer (GPT style) over bytes or tokens: token and position
    embeddings, `depth` blocks of causal self-attention and an MLP (pre-norm, residual), a final
    norm and a linear head. Two ways to call it:

    - `model(x)`, for task=language_model's (inputs, next tokens) pairs: logits as (batch, vocab,
      time), so `cross_entropy(logits, targets)` with targets (batch, time) is the per-token loss
      and argmax over dim 1 the next-token prediction, as a classifier's.
    - `model(input_ids=..., position_ids=..., attention_mask=...)`, for task=causal_lm's dict
      batches as a Hugging Face causal model takes them: an LMOutput whose logits are (batch, time,
      vocab). Position ids that restart mid-row mark packed documents: each token attends only to
      the earlier tokens of its own document, and its position embedding counts from its document's
      start. Right padding (the project's collator's) needs no mask: a causal model's real tokens
      never attend to the padding after them, and the attention mask is not read.

    Attention and MLP are Megatron-shaped (q, k, v and the first MLP layer, then one projection
    back: `tp_plan` splits them for tensor parallel), and the blocks are its FSDP units
    (`shard_units`)."""

    def __init__(
        self,
        vocab_size: int = 256,
        context: int = 64,
        dim: int = 128,
        depth: int = 4,
        heads: int = 4,
        mlp_ratio: int = 4,
    ):
        super().__init__()
        if dim % heads:
            raise ValueError(f"TinyGPT: dim ({dim}) must be a multiple of heads ({heads})")
        self.context = context
        self.tokens = nn.Embedding(vocab_size, dim)
        self.positions = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(_Block(dim, heads, mlp_ratio) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)

    def forward(
        self,
        x: Optional[torch.Tensor] = None,
        input_ids: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor | LMOutput:
        ids = x if x is not None else input_ids
        if ids is None:
            raise TypeError("TinyGPT takes its token ids: model(x) or model(input_ids=...)")
        if position_ids is None:
            h = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
            mask = None  # one causal sequence per row
        else:
            h = self.tokens(ids) + self.positions(position_ids)
            mask = same_document_causal_mask(position_ids)
        for block in self.blocks:
            h = block(h, mask)
        logits = self.head(self.norm(h))
        return logits.transpose(1, 2) if x is not None else LMOutput(logits)

    def get_input_embeddings(self) -> nn.Embedding:
        """The token embedding (as transformers' models name it): its rows are the vocabulary."""
        return self.tokens

    def shard_units(self) -> list[nn.Module]:
        return list(self.blocks)

    def tp_plan(self, size: int) -> dict[str, str]:
        """Tensor parallel over `size` ranks, Megatron style: in each block q, k, v and the first
        MLP layer split by output (whole heads per rank), the projections back split by input."""
        block = self.blocks[0]
        heads, hidden = block.q.out_features // block.head_dim, block.fc1.out_features
        if heads % size or hidden % size:
            raise ValueError(
                f"TinyGPT: {heads} heads and an MLP of {hidden} do not split over {size} ranks; "
                "choose model.heads (and dim × mlp_ratio) divisible by the world size"
            )
        styles = {
            "q": "colwise",
            "k": "colwise",
            "v": "colwise",
            "proj": "rowwise",
            "fc1": "colwise",
            "fc2": "rowwise",
        }
        return {
            f"blocks.{i}.{name}": style
            for i in range(len(self.blocks))
            for name, style in styles.items()
        }


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: int):
        super().__init__()
        self.head_dim = dim // heads
        self.norm1 = nn.LayerNorm(dim)
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, mlp_ratio * dim)
        self.fc2 = nn.Linear(mlp_ratio * dim, dim)

    def forward(self, h: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`mask`: (batch, 1, time, time), True where a query may attend to a key; None: causal."""
        batch, time, _ = h.shape
        x = self.norm1(h)
        # (batch, heads, time, head_dim); heads counted from the width, as a sharded q/k/v has fewer
        q, k, v = (
            f(x).view(batch, time, -1, self.head_dim).transpose(1, 2)
            for f in (self.q, self.k, self.v)
        )
        if mask is None:
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        h = h + self.proj(attended.transpose(1, 2).reshape(batch, time, -1))
        return h + self.fc2(F.gelu(self.fc1(self.norm2(h))))


def same_document_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """(batch, 1, time, time): query t may attend to key s when s <= t and both lie in one document.
    A document starts wherever the position ids do not go on by one (transformers' rule for packed
    sequences), so a row of several documents, each counted from 0, attends within each."""
    restarts = torch.ones_like(position_ids, dtype=torch.bool)
    restarts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    document = restarts.cumsum(1)
    time = position_ids.shape[1]
    causal = torch.ones(time, time, dtype=torch.bool, device=position_ids.device).tril()
    return ((document[:, :, None] == document[:, None, :]) & causal)[:, None]
