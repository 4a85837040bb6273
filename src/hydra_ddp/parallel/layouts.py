"""The wrapped model's state as checkpoints hold it, in two layouts: whole (DDP: rank 0 writes one
file) or this rank's shards (FSDP, TP: torch.distributed.checkpoint). Both are keyed by the plain
module's parameter names, so either loads at any world size and under any strategy."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

_WRAPPERS = ("_checkpoint_wrapped_module", "_orig_mod")  # attributes that wrap a module in another


def optimizer_state_by_name(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """`optimizer.state_dict()` with each parameter's position replaced by its name in `module`:
    what torch.distributed.checkpoint's get_optimizer_state_dict returns for a module that every
    rank holds whole (tests/e2e/test_strategy.py compares the two). Done here, that module's import
    is not in every worker's start-up, and each save is cheaper.

    Unlike it, an optimizer with no state yet is not stepped once (at lr 0) to make some: saving
    changes nothing. A parameter shared by two modules has its first name, as named_parameters gives
    it."""
    names = {param: _plain_name(name) for name, param in module.named_parameters()}
    by_position = [names[param] for group in optimizer.param_groups for param in group["params"]]
    state = optimizer.state_dict()
    return {
        "state": {by_position[index]: value for index, value in state["state"].items()},
        "param_groups": [
            {**group, "params": [by_position[index] for index in group["params"]]}
            for group in state["param_groups"]
        ],
    }


def _plain_name(name: str) -> str:
    """A parameter's name without the wrappers' attributes in it (activation checkpointing's,
    torch.compile's), as DCP names it."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPERS)


def _full() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True)


class WholeState:
    """Every rank holds the whole module (DDP's replicas)."""

    sharded = False  # rank 0 holds everything: it writes one file

    def __init__(self, module: nn.Module, wrapped: nn.Module):
        self.module, self.wrapped = module, wrapped

    def model_state(self) -> dict[str, torch.Tensor]:
        """The full weights, on rank 0 at least (here every rank has them)."""
        return self.module.state_dict()

    def load_model_state(self, state: dict[str, torch.Tensor], everywhere: bool = True) -> None:
        self.module.load_state_dict(state)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Keyed by parameter name (not position): the same layout FSDP's full state has."""
        return optimizer_state_by_name(self.module, optimizer)

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.wrapped, optimizer, state, options=_full())

    def checkpoint_model_state(self) -> dict[str, torch.Tensor]:
        """The model's state as a checkpoint holds it: the full state."""
        return self.module.state_dict()

    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The model and optimizer as a checkpoint holds them: here the full state (one file)."""
        return {"model": self.model_state(), "optimizer": self.optimizer_state(optimizer)}

    def local_tensors(self) -> Iterator[torch.Tensor]:
        """This rank's share of the parameters (the whole of them)."""
        return (p.detach() for p in self.module.parameters())


class ShardedState:
    """Each rank holds its shards (DTensors) of the module: FSDP's, tensor parallel's or both."""

    sharded = True  # each rank writes its own shards: no rank gathers the full state

    def __init__(self, module: nn.Module):
        self.module = module

    def model_state(self) -> dict[str, torch.Tensor]:
        """Gathered: the full weights on rank 0 (on the CPU), none on the other ranks."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        return get_model_state_dict(
            self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )

    def load_model_state(self, state: dict[str, torch.Tensor], everywhere: bool = True) -> None:
        """Each rank keeps its shard of the full weights: read by every rank (`everywhere`), or
        held by rank 0 alone and sent from there."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        set_model_state_dict(
            self.module,
            state,
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=not everywhere),
        )

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        return get_optimizer_state_dict(
            self.module, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.module, optimizer, state, options=_full())

    def checkpoint_model_state(self) -> dict[str, torch.Tensor]:
        """This rank's shards (DTensors) of the model's state, as DCP saves them."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.module)

    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This rank's shards (DTensors) of the model and optimizer state, as DCP saves them."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.module, optimizer)
        return {"model": model_state, "optimizer": optimizer_state}

    def local_tensors(self) -> Iterator[torch.Tensor]:
        return (
            p.detach().to_local() if hasattr(p, "to_local") else p.detach()
            for p in self.module.parameters()
        )


def load_sharded(wrapped: nn.Module, path: Any, optimizer: torch.optim.Optimizer) -> None:
    """A sharded (DCP) checkpoint into this rank's model and optimizer, under any strategy: DCP
    reads the parts of the saved shards that this rank's layout needs, whatever layout they were
    saved in."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(wrapped, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        wrapped, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )


def load_sharded_model(wrapped: nn.Module, path: Any, part: str) -> None:
    """A sharded checkpoint's `part` (a model state: "ema", the moving average) into the model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = {part: get_model_state_dict(wrapped)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(wrapped, state[part])
