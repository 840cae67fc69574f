"""Checkpoints that reshard (DCP) and Hugging Face tensors gathered one at a time for publishing.

DCP: after `apply_parallelism` every parameter is a DTensor that knows its full shape, dense ones
sharded over the FSDP mesh and expert ones over (expert_shard, ep). torch.distributed.checkpoint
writes each rank's shards with their global offsets, so a checkpoint written at one world size
and layout loads at any other (including world size 1 with a plain, unsharded model). This is the
one DCP save/load; the trainer adds its own entries (scheduler, RNG, step) through `extra`.

    save_dcp(path, model, optimizer, extra={"trainer": {...}})            # every rank
    extra = load_dcp(path, model, optimizer, extra={"trainer": template})  # every rank, any layout

On disk the state is {"model": model state, "optim": optimizer state, **extra}.

Publishing: `iter_full_tensors` walks the published entries and gathers ONE full tensor at a time
onto the ranks that write it (each rank writes its share of the files); `iter_hf_tensors` is the
one-writer form (everything to rank 0, in Hugging Face names). No rank ever holds the whole model.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

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
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from asyncrl.model import Transformer
from asyncrl.model.hf import is_hf_tensor, to_hf_tensors

__all__ = [
    "gather_to_rank",
    "gather_to_rank0",
    "iter_full_tensors",
    "iter_hf_tensors",
    "load_dcp",
    "load_full_state_dict",
    "save_dcp",
]

_RESERVED_KEYS = ("model", "optim")


@contextmanager
def _single_process_quiet():
    """World size 1 is a supported case (resume on one process), not something to warn about."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def _dcp_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, extra: dict[str, Any] | None
) -> dict[str, Any]:
    clash = sorted(set(extra or {}) & set(_RESERVED_KEYS))
    if clash:
        raise ValueError(f"extra checkpoint entries may not be named {clash}: DCP keeps model/optim there")
    if optimizer is None:
        state: dict[str, Any] = {"model": get_model_state_dict(model)}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    return state | (extra or {})


def save_dcp(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: dict[str, Any] | None = None,
) -> None:
    """Write model (and optimizer, and `extra` entries: tensors or plain values) with DCP; collective."""
    state = _dcp_state(model, optimizer, extra)
    with _single_process_quiet():
        dcp.save(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())


def load_dcp(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Load a DCP checkpoint written at any world size / layout into `model` (and optimizer).

    `extra` holds templates of the entries `save_dcp` was given (same keys, values of the same
    kind); they are filled from the checkpoint and returned.
    """
    state = _dcp_state(model, optimizer, extra)
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return {key: state[key] for key in extra or {}}


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor] | None) -> None:
    """Load a full (unsharded, our naming) state dict into a parallelised model, e.g. HF weights.

    Rank 0 passes the tensors (from `asyncrl.model.hf.load_state_dict`), the other ranks pass None:
    each tensor is broadcast from rank 0 and every rank keeps only its shard.
    """
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=dist.is_initialized())
    set_model_state_dict(model, state if state is not None else {}, options=options)


def gather_to_rank(value: torch.Tensor, dst: int, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """The full tensor on global rank `dst` (None elsewhere); each rank sends only its own shard.

    For a DTensor on a mesh spanning the world: every rank sends its local shard and its global
    offset to `dst` (gathers padded to the largest shard), and `dst` places the shards; ranks
    that hold replicated copies just write the same values twice. A plain tensor (the same on
    every rank) is returned as is on `dst`. With `dtype`, each shard is cast before it is sent
    (bf16 halves the bytes of an fp32 gather; a cast is elementwise, so the result is the same).
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    if not isinstance(value, DTensor):
        return (value if dtype is None else value.to(dtype)) if rank == dst else None
    assert value.device_mesh.size() == dist.get_world_size(), "meshes built by ParallelDims span the world"
    local = value.to_local().contiguous()
    local = local if dtype is None else local.to(dtype)
    shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    meta = torch.tensor([*shape, *offset], dtype=torch.int64, device=local.device)
    world = dist.get_world_size()
    metas = [torch.empty_like(meta) for _ in range(world)] if rank == dst else None
    dist.gather(meta, metas, dst=dst)
    n = len(shape)
    max_numel = max(math.prod(m[:n].tolist()) for m in metas) if metas else 0
    size = torch.tensor([max_numel], dtype=torch.int64, device=local.device)
    dist.broadcast(size, src=dst)  # every rank pads its shard to the largest one
    padded = local.new_zeros(int(size[0]))
    padded[: local.numel()] = local.reshape(-1)
    parts = [torch.empty_like(padded) for _ in range(world)] if rank == dst else None
    dist.gather(padded, parts, dst=dst)
    if rank != dst:
        return None
    full = local.new_empty(value.shape)
    for m, part in zip(metas, parts):
        shard_shape, shard_offset = m[:n].tolist(), m[n:].tolist()
        index = tuple(slice(o, o + k) for o, k in zip(shard_offset, shard_shape))
        full[index] = part[: math.prod(shard_shape)].view(shard_shape)
    return full


def gather_to_rank0(value: torch.Tensor) -> torch.Tensor | None:
    """`gather_to_rank(value, 0)`."""
    return gather_to_rank(value, 0)


def iter_full_tensors(
    model: Transformer,
    owners: Callable[[str], Collection[int]],
    dtype: Callable[[str], torch.dtype | None] = lambda name: None,
    copy: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (our name, full tensor) of every published entry on each rank in `owners(name)`.

    Collective: every rank must exhaust the iterator. Entries are gathered one at a time, once per
    owner (`gather_to_rank`, in `dtype(name)` unless None), so a rank holds its own shards plus one
    full tensor at a time (the caller keeps what it needs). A tensor that needs no gather (world
    size 1, or not sharded) may be the model's own; copy=True makes every one new storage.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    for name, value in model.state_dict().items():  # checkpoint wrappers drop their prefix here
        if not is_hf_tensor(name, model.args):
            continue
        for dst in sorted(owners(name)):
            if isinstance(value, DTensor):
                full = gather_to_rank(value, dst, dtype(name))  # new storage
            else:
                full = value.to(dtype(name) or value.dtype, copy=copy) if dst == rank else None
            if full is not None:
                assert dst == rank
                yield name, full
            del full


def iter_hf_tensors(model: Transformer) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, full tensor) on rank 0; every rank must exhaust the iterator.

    The one-writer path: tensors are gathered one at a time onto rank 0 only, so the other ranks
    never hold more than their own shards, and rank 0 at most one full tensor beyond its shards.
    Names and expert unstacking are `asyncrl.model.hf`'s, so the pairs feed `HFCheckpointWriter`.
    """
    for name, full in iter_full_tensors(model, lambda name: (0,)):
        yield from to_hf_tensors(name, full)
