"""What each trainer rank sends: its own shards of the published tensors, in the serving format.

    fmt = serving_format(model, torch.bfloat16, fp8=True)   # asyncrl.model.serving
    for shard in iter_shards(model, fmt):                    # on every trainer rank
        ...

Nothing is gathered. A DTensor's local shard is sent by the rank that holds it, with its offset
in the full tensor; where the mesh replicates (a `Replicate` placement: HSDP's replica dim), only
the holder at coordinate 0 of every such dim sends, so each element is sent by exactly one rank.
A plain tensor (the same on every rank) is sent by global rank 0. The published tensors are those
of the files (`asyncrl.model.hf.is_hf_tensor`: a tied LM head is not one).

A weight the format stores as block FP8 is quantised here, to the blocks the file publisher
writes (`asyncrl.model.fp8.quantize_weight` of the whole weight): a 128-row block may straddle two
ranks' rows, so each rank takes the amax of the part of each block it holds, and one all-reduce
(max) over the trainer's group gives every rank the whole weight's scales. The scales travel as
their own tensor, `<name>_scale_inv` ([E,] Ob, Kb), sent by rank 0. That all-reduce makes the walk
collective when FP8 is on: every rank must exhaust the iterator, entries in the same order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from asyncrl.model import Transformer
from asyncrl.model.fp8 import AMAX_FLOOR, BLOCK, FP8_DTYPE, FP8_MAX
from asyncrl.model.hf import is_hf_tensor, to_hf_tensors
from asyncrl.model.serving import SCALE_SUFFIX, ServingFormat, to_serving
from asyncrl.weight_transfer.buckets import Changes, Shard, copy_differing, shard_key

__all__ = ["iter_shards", "published_shapes"]


def published_shapes(model: Transformer, fmt: ServingFormat) -> dict[str, tuple[int, ...]]:
    """Every tensor a version of `model` in `fmt` is made of (our names, FP8 scales too) and its
    full shape: what a receiver expects."""
    shapes = {}
    for name, t in model.state_dict().items():
        if is_hf_tensor(name, model.args):
            shapes[name] = tuple(t.shape)
            if _is_fp8(name, t, fmt):
                shapes[name + SCALE_SUFFIX] = _scale_shape(tuple(t.shape))
    return shapes


def iter_shards(
    model: Transformer, fmt: ServingFormat, *, into: Iterable[Shard] = (), against: Iterable[Shard] = ()
) -> Iterator[Shard]:
    """This rank's shards of `model`'s published tensors in `fmt`, in storage of their own (a
    snapshot that later in-place optimizer steps do not change). `into`: an earlier snapshot of the
    same model that nothing reads any more; its memory is written over where a shard matches (not
    for FP8 weights), which spares the page faults of fresh memory, the larger part of a snapshot's
    cost on a CPU. `against`: the snapshot a delta will be sent against; each shard that has a match
    there carries its `Changes`, found while it is copied (`copy_differing`)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    spare = {s.key: s.values for s in into}
    bases = {s.key: s.values for s in against}
    for name, value in model.state_dict().items():  # checkpoint wrappers drop their prefix here
        if not is_hf_tensor(name, model.args):
            continue
        shape = tuple(value.shape)
        local, local_shape, offset, sends = _local(value, rank)
        if _is_fp8(name, value, fmt):
            q, scale = _quantize_shard(local.detach(), shape, local_shape, offset)
            if rank == 0:
                yield _shard(name + SCALE_SUFFIX, scale.shape, (0,) * scale.dim(), scale.shape, scale)
            local = q
            changes = None
        else:
            key = shard_key(name, offset)
            local, changes = _copy(local.detach(), fmt.dtype, spare.get(key), bases.get(key))
        if sends and local.numel():  # an uneven split can leave a rank without rows
            yield _shard(name, shape, offset, local_shape, local, changes)


def _copy(
    local: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None, base: torch.Tensor | None
) -> tuple[torch.Tensor, Changes | None]:
    """`local` cast to `dtype` in new storage, or in `out` (flat) where it fits; and its changes
    against `base` (flat) where that matches."""
    if out is None or not _fits(out, local, dtype):
        out = torch.empty(local.numel(), dtype=dtype, device=local.device)
    if base is None or not _fits(base, local, dtype):
        return out.view(local.shape).copy_(local), None
    changes = copy_differing(out, local.reshape(-1), base)
    return out.view(local.shape), changes


def _fits(t: torch.Tensor, local: torch.Tensor, dtype: torch.dtype) -> bool:
    return t.dtype == dtype and t.numel() == local.numel() and t.device == local.device


def _local(value: torch.Tensor, rank: int) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...], bool]:
    """(local shard, its shape, its offset, whether this rank sends it)."""
    if not isinstance(value, DTensor):
        return value, tuple(value.shape), (0,) * value.dim(), rank == 0
    local_shape, offset = compute_local_shape_and_global_offset(
        value.shape, value.device_mesh, value.placements
    )
    return value.to_local(), tuple(local_shape), tuple(offset), _sends(value)


def _shard(
    name: str, shape, offset, local_shape, values: torch.Tensor, changes: Changes | None = None
) -> Shard:
    return Shard(
        name=name,
        shape=tuple(shape),
        offset=tuple(offset),
        local_shape=tuple(local_shape),
        values=values.contiguous().view(-1),
        changes=changes,
    )


def _sends(value: DTensor) -> bool:
    """Whether this rank is the one holder of its shard that sends it (coordinate 0 where replicated)."""
    coordinate = value.device_mesh.get_coordinate()
    assert coordinate is not None, "every trainer rank is on the meshes of its parameters"
    return all(c == 0 for c, p in zip(coordinate, value.placements) if p.is_replicate())


def _is_fp8(name: str, value: torch.Tensor, fmt: ServingFormat) -> bool:
    """Whether `fmt` stores our entry `name` as FP8 blocks (asked of its first HF tensor, on meta)."""
    if not fmt.fp8:
        return False
    hf_name, hf = next(to_hf_tensors(name, torch.empty(value.shape, device="meta")))
    return sum(1 for _ in to_serving(hf_name, hf, fmt)) == 2


def _scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    *lead, out_dim, K = shape
    return (*lead, -(-out_dim // BLOCK), -(-K // BLOCK))


def _quantize_shard(
    local: torch.Tensor, shape: tuple[int, ...], local_shape: tuple[int, ...], offset: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's rows in FP8, the whole weight's block scales): the bits `quantize_weight` gives
    for the whole weight. Collective over the trainer's group."""
    amax = partial_amax(local, shape, local_shape, offset)
    if dist.is_initialized():
        dist.all_reduce(amax, op=dist.ReduceOp.MAX)
    if not bool(torch.isfinite(amax).all()):
        raise ValueError(
            "fp8: a published weight holds NaN or inf; lower the learning rate or check the step"
        )
    scale = amax.clamp(min=AMAX_FLOOR) / FP8_MAX
    return quantize_rows(local, scale, local_shape, offset), scale


def _rows(local_shape: tuple[int, ...], offset: tuple[int, ...]) -> tuple[tuple[slice, ...], slice, int, int]:
    """(the shard's leading-dim index, its rows inside its block window, first block, end block)."""
    r0, n = offset[-2], local_shape[-2]
    b0, b1 = r0 // BLOCK, -(-(r0 + n) // BLOCK)
    lead = tuple(slice(o, o + k) for o, k in zip(offset[:-2], local_shape[:-2]))
    return lead, slice(r0 - b0 * BLOCK, r0 - b0 * BLOCK + n), b0, b1


def partial_amax(
    local: torch.Tensor, shape: tuple[int, ...], local_shape: tuple[int, ...], offset: tuple[int, ...]
) -> torch.Tensor:
    """The amax of each 128x128 block over this shard's elements (0 for blocks it does not touch);
    the max over the shards of a weight is the whole weight's. Shape legend: ... the leading
    (expert) dims of the shard, b the row blocks its rows touch, K the input dim."""
    assert local_shape[-1] == shape[-1], "weights are sharded by rows (or experts), never by input dim"
    lead, rows, b0, b1 = _rows(local_shape, offset)
    K = shape[-1]
    amax = torch.zeros(_scale_shape(shape), device=local.device)
    if local.numel():
        window_bK = torch.zeros((*local_shape[:-2], (b1 - b0) * BLOCK, K), device=local.device)
        window_bK[..., rows, :] = local.float().abs()
        blocks = window_bK.view(*local_shape[:-2], b1 - b0, BLOCK, K // BLOCK, BLOCK)
        amax[(*lead, slice(b0, b1))] = blocks.amax(dim=(-3, -1))
    return amax


def quantize_rows(
    local: torch.Tensor, scale: torch.Tensor, local_shape: tuple[int, ...], offset: tuple[int, ...]
) -> torch.Tensor:
    """This shard's elements in FP8 under the whole weight's block `scale`."""
    lead, rows, b0, b1 = _rows(local_shape, offset)
    scale_nK = scale[(*lead, slice(b0, b1))].repeat_interleave(BLOCK, dim=-2)[..., rows, :]
    scale_nK = scale_nK.repeat_interleave(BLOCK, dim=-1)
    # quantize_weight's rounding: divide, clamp (a rounding step can pass 448), cast
    return (local.float() / scale_nK).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
