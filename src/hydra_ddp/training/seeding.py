"""What makes a run repeatable: the seed every random stream starts from, and, on GPUs, kernels
that give the same bits run after run."""

from __future__ import annotations

import os
import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def deterministic_kernels() -> None:
    """trainer.deterministic: kernels that give the same bits run after run on GPUs. cuDNN's
    convolution choice and its nondeterministic backward (max-pool's, scatter-adds), TF32's rounding
    and cuBLAS's split reductions otherwise vary between runs; torch raises where an op has no
    deterministic kernel. NCCL's sums are left as NCCL orders them (the same for the same world size
    and topology)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
