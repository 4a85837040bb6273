"""Every rank's random streams in a checkpoint (torch's, CUDA's, NumPy's, Python's): packed into one
tensor per rank, gathered to the writer, and each rank's put back on resume."""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.distributed as dist


# RNG states travel as one float64 vector per rank (every value is an integer below 2**53, or a
# float): one all_gather collects them all, and a tensor is what weights_only loading accepts.
def pack(device: torch.device) -> torch.Tensor:
    _, keys, pos, has_gauss, cached = np.random.get_state()
    version, py_state, gauss_next = random.getstate()
    parts = [
        torch.get_rng_state().double(),
        torch.from_numpy(keys.astype(np.float64)),
        torch.tensor(
            [pos, has_gauss, cached, version, np.nan if gauss_next is None else gauss_next],
            dtype=torch.float64,
        ),
        torch.tensor(py_state, dtype=torch.float64),
    ]
    if device.type == "cuda":
        parts.append(torch.cuda.get_rng_state(device).double())
    return torch.cat(parts)


def unpack(packed: torch.Tensor, device: torch.device) -> None:
    torch_size = torch.get_rng_state().numel()
    torch_state, rest = packed[:torch_size], packed[torch_size:]
    keys, (pos, has_gauss, cached, version, gauss_next), rest = (
        rest[:624],
        rest[624:629].tolist(),
        rest[629:],
    )
    py_state, cuda_state = rest[:625], rest[625:]
    torch.set_rng_state(torch_state.to(torch.uint8))
    np.random.set_state(
        ("MT19937", keys.numpy().astype(np.uint32), int(pos), int(has_gauss), cached)
    )
    random.setstate(
        (
            int(version),
            tuple(int(v) for v in py_state.tolist()),
            None if np.isnan(gauss_next) else gauss_next,
        )
    )
    if device.type == "cuda" and cuda_state.numel():
        torch.cuda.set_rng_state(cuda_state.to(torch.uint8), device)


def gather(device: torch.device) -> list[torch.Tensor]:
    mine = pack(device).to(device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [t.cpu() for t in everyone]
