"""The shared-memory all-reduce (strategy.shared_memory), in this process: where it cannot serve, it
says why (real processes meeting in a real segment: tests/e2e/test_shared_memory.py)."""

from __future__ import annotations

import platform

from hydra_ddp.parallel import shared_memory


def test_where_it_cannot_serve_it_says_why():
    here = platform.machine()
    expected = (
        []
        if here.lower() in ("x86_64", "amd64")
        else [f"it relies on x86-64's store order (this is {here})"]
    )
    assert shared_memory.unavailable("gloo", "cpu", 2, 2) == expected
    assert any(
        "not every rank is on this host (2 of 4)" in r
        for r in shared_memory.unavailable("gloo", "cpu", 4, 2)
    )
    assert any("CPU tensors" in r for r in shared_memory.unavailable("nccl", "cuda", 2, 2))
