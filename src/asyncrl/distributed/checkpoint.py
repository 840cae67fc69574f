"""Checkpoints that reshard (DCP) and Hugging Face tensors gathered one at a time for publishing.

DCP: after `apply_parallelism` every parameter is a DTensor that knows its full shape, dense ones
sharded over the FSDP mesh and expert ones over (expert_shard, ep). torch.distributed.checkpoint
writes each rank's shards with their global offsets, so a checkpoint written at one world size
and layout loads at any other (including world size 1 with a plain, unsharded model).

    save_model_dcp(model, path, optimizer)      # every rank
    load_model_dcp(model, path, optimizer)      # every rank, any layout

Publishing: `iter_hf_tensors` walks the parameters in Hugging Face names, gathering ONE full
tensor at a time (stacked experts are unstacked per expert), so no rank ever holds the whole
model; only rank 0 receives the tensors, the other ranks just join the gathers.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

__all__ = ["iter_hf_tensors", "load_full_state_dict", "load_model_dcp", "save_model_dcp"]

_AC_PREFIX = "_checkpoint_wrapped_module."


@contextmanager
def _single_process_quiet():
    """World size 1 is a supported case (resume on one process), not something to warn about."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def save_model_dcp(
    model: nn.Module, path: str | Path, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Write model (and optimizer) state with DCP; collective over all ranks."""
    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optimizer": optim_sd}
    with _single_process_quiet():
        dcp.save(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())


def load_model_dcp(
    model: nn.Module, path: str | Path, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Load a DCP checkpoint written at any world size / layout into `model` (and optimizer)."""
    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
        set_model_state_dict(model, state["model"])
        return
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor] | None) -> None:
    """Load a full (unsharded, our naming) state dict into a parallelised model, e.g. HF weights.

    Rank 0 passes the tensors (from `asyncrl.model.hf.load_state_dict`), the other ranks pass None:
    each tensor is broadcast from rank 0 and every rank keeps only its shard.
    """
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=dist.is_initialized())
    set_model_state_dict(model, state if state is not None else {}, options=options)


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def iter_hf_tensors(
    model: nn.Module, *, tie_word_embeddings: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, full tensor) on rank 0; every rank must exhaust the iterator.

    Each DTensor is gathered on its own (at most one full tensor alive per rank at a time).
    """
    for name, value in model.state_dict().items():
        name = name.replace(_AC_PREFIX, "")
        if name == "lm_head.weight" and tie_word_embeddings:
            continue
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if not _is_main():
            continue
        if name.startswith("model.layers.") and ".mlp.experts." in name:
            prefix, proj = name.rsplit(".", 1)
            for e in range(full.shape[0]):
                yield f"{prefix}.{e}.{proj}.weight", full[e]
        else:
            yield name, full
        del full
