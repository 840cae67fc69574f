"""What each trainer rank sends: its own shards of the published tensors, in the serving dtype.

    for shard in iter_shards(model, torch.bfloat16):   # on every trainer rank; no collective
        ...

Nothing is gathered. A DTensor's local shard is sent by the rank that holds it, with its offset
in the full tensor; where the mesh replicates (a `Replicate` placement: HSDP's replica dim), only
the holder at coordinate 0 of every such dim sends, so each element is sent by exactly one rank.
A plain tensor (the same on every rank) is sent by global rank 0. The published tensors are those
of the files (`asyncrl.model.hf.is_hf_tensor`: a tied LM head is not one).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from asyncrl.model import Transformer
from asyncrl.model.hf import is_hf_tensor
from asyncrl.weight_transfer.buckets import Shard

__all__ = ["iter_shards", "published_shapes"]


def published_shapes(model: Transformer) -> dict[str, tuple[int, ...]]:
    """Every published tensor of `model` (our names) and its full shape: what a receiver expects."""
    return {n: tuple(t.shape) for n, t in model.state_dict().items() if is_hf_tensor(n, model.args)}


def iter_shards(model: Transformer, dtype: torch.dtype) -> Iterator[Shard]:
    """This rank's shards of `model`'s published tensors, cast to `dtype` in new storage (a snapshot
    that later in-place optimizer steps do not change)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    for name, value in model.state_dict().items():  # checkpoint wrappers drop their prefix here
        if not is_hf_tensor(name, model.args):
            continue
        shape = tuple(value.shape)
        if isinstance(value, DTensor):
            if not _sends(value):
                continue
            local_shape, offset = compute_local_shape_and_global_offset(
                value.shape, value.device_mesh, value.placements
            )
            local = value.to_local()
        elif rank == 0:
            local_shape, offset, local = shape, (0,) * len(shape), value
        else:
            continue
        if local.numel() == 0:
            continue  # an uneven split can leave a rank without rows
        values = local.detach().to(dtype, copy=True).contiguous().view(-1)
        yield Shard(
            name=name, shape=shape, offset=tuple(offset), local_shape=tuple(local_shape), values=values
        )


def _sends(value: DTensor) -> bool:
    """Whether this rank is the one holder of its shard that sends it (coordinate 0 where replicated)."""
    coordinate = value.device_mesh.get_coordinate()
    assert coordinate is not None, "every trainer rank is on the meshes of its parameters"
    return all(c == 0 for c, p in zip(coordinate, value.placements) if p.is_replicate())
