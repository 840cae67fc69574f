"""Apply parallelism to a `Transformer` from outside, torchtitan-style: EP, then AC, then FSDP2.

    dims = ParallelDims.build(world_size=dist.get_world_size(), **cfg.parallel_degrees, ...)
    meshes = dims.build_meshes("cuda")
    apply_parallelism(model, dims, meshes, device_type="cuda", activation_checkpointing=True)

- EP: every `GroupedExperts` becomes an `ExpertParallelExperts` holding E/ep experts (DTensors
  Shard(0) on the `ep` axis).
- MTP layers (frozen, `asyncrl.model.mtp`) become DTensor buffers sharded on dim 0 over the
  FSDP mesh: each rank holds 1/N of them.
- CP needs no module change: it is an attention backend built per micro-batch
  (`ContextParallelAttention`) plus splitting of the per-token streams.
- Activation checkpointing wraps each decoder block (recomputed in backward).
- FSDP2 (`fully_shard`) per block, then the root (embeddings, final norm, LM head). Dense weights
  are sharded over (dp_replicate, dp_shard * cp); expert weights over what EP leaves,
  (dp_replicate, dp_shard * cp / ep), on dim 1 so the expert dim stays whole per EP rank.
  Mixed precision: fp32 on CPU; bf16 parameters with fp32 gradient reduction on GPU. The router
  gets its own fp32 FSDP group (`cast_forward_inputs=False`), so its logits never see bf16 weights.

Gradients are reduced with a SUM (divide factor 1), not a mean: the trainer divides its loss by
the global number of loss tokens, so the sum over ranks is the gradient of the global token mean
(the same convention as the world-size-1 path).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from asyncrl.distributed.dims import Meshes, ParallelDims
from asyncrl.distributed.expert_parallel import apply_expert_parallel
from asyncrl.model.moe import MoE
from asyncrl.model.mtp import PassthroughTensors

__all__ = ["apply_parallelism", "clip_grad_norm_", "mixed_precision_policy"]

_ROUTER_POLICY = MixedPrecisionPolicy(
    param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False
)


def mixed_precision_policy(device_type: str) -> MixedPrecisionPolicy:
    """bf16 compute with fp32 reduction on GPU; plain fp32 elsewhere."""
    if device_type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_parallelism(
    model: nn.Module,
    dims: ParallelDims,
    meshes: Meshes,
    *,
    device_type: str,
    activation_checkpointing: bool = False,
    reshard_after_forward: bool = True,
    mixed_precision: MixedPrecisionPolicy | None = None,
) -> nn.Module:
    """Make `model` (a `Transformer`, already holding its full weights or on meta) parallel in place.

    `mixed_precision` defaults to `mixed_precision_policy(device_type)`; routers are fp32 regardless.
    """
    if dims.ep_enabled:
        assert meshes.expert is not None
        num_swapped = apply_expert_parallel(model, meshes.expert["ep"])
        assert num_swapped > 0, "ParallelDims rejects ep > 1 for a model without experts"
    _shard_passthrough(model, _fsdp_mesh(meshes, dims))
    if activation_checkpointing:
        _apply_activation_checkpointing(model)
    mp = mixed_precision if mixed_precision is not None else mixed_precision_policy(device_type)
    _apply_fsdp(model, dims, meshes, mp, reshard_after_forward)
    return model


def _shard_passthrough(model: nn.Module, mesh: DeviceMesh) -> None:
    """Shard the frozen pass-through tensors (MTP layers) on dim 0 over the FSDP mesh.

    Nothing trains or reads them, so they need no FSDP group: as DTensor buffers each rank holds
    1/N of them, DCP reshards them like parameters, and publishing gathers them like parameters.
    """
    placements = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
    for module in model.modules():
        if not isinstance(module, PassthroughTensors):
            continue
        for name, buf in list(module.named_buffers(recurse=False)):
            if isinstance(buf, DTensor) or buf.dim() == 0:
                continue
            # src_data_rank=None: each rank keeps its own block of its own copy (or meta), no comms
            module.register_buffer(name, distribute_tensor(buf, mesh, placements, src_data_rank=None))


def _apply_activation_checkpointing(model: nn.Module) -> None:
    layers = model.model.layers
    for i, layer in enumerate(layers):
        # CheckpointWrapper forwards attribute access (is_moe, layer_idx) to the block, and state
        # dicts drop its `_checkpoint_wrapped_module.` prefix, so names stay Hugging Face's.
        layers[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


def _fsdp_mesh(meshes: Meshes, dims: ParallelDims):
    return meshes.fsdp if dims.dp_replicate > 1 else meshes.fsdp["dp_shard_cp"]


def _expert_fsdp_mesh(meshes: Meshes, dims: ParallelDims):
    return meshes.expert_fsdp if dims.dp_replicate > 1 else meshes.expert["expert_shard"]


def _apply_fsdp(
    model: nn.Module, dims: ParallelDims, meshes: Meshes, mp: MixedPrecisionPolicy, reshard: bool
) -> None:
    mesh = _fsdp_mesh(meshes, dims)
    for layer in model.model.layers:
        for module in layer.modules():
            if not isinstance(module, MoE):
                continue
            fully_shard(module.gate, mesh=mesh, mp_policy=_ROUTER_POLICY, reshard_after_forward=reshard)
            if dims.ep_enabled:
                fully_shard(
                    module.experts,
                    mesh=_expert_fsdp_mesh(meshes, dims),
                    mp_policy=mp,
                    reshard_after_forward=reshard,
                    shard_placement_fn=lambda _p: Shard(1),
                )
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    # The root group (embeddings, final norm, LM head) stays gathered after forward: the trainer
    # applies the LM head to the hidden states outside the model's forward (chunked logprobs).
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)


@torch.no_grad()
def clip_grad_norm_(parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip by the global L2 norm over gradients living on different meshes (dense vs expert).

    `torch.nn.utils.clip_grad_norm_` cannot combine DTensors from different meshes. Here the
    local squared norms are grouped by (mesh, placements), summed over the sharded mesh axes in
    one all-reduce per group and axis (replicated axes hold copies and are not summed), then added.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    groups: dict[tuple, list[torch.Tensor]] = {}
    plain = []
    for g in grads:
        if isinstance(g, DTensor):
            groups.setdefault((g.device_mesh, g.placements), []).append(g.to_local())
        else:
            plain.append(g)
    total_sq = torch.zeros((), dtype=torch.float32, device=grads[0].device)
    for (mesh, placements), locals_ in groups.items():
        sq = torch.stack([t.float().pow(2).sum() for t in locals_]).sum()
        for axis, placement in enumerate(placements):
            if placement.is_shard():
                dist.all_reduce(sq, group=mesh.get_group(axis))
        total_sq += sq.to(total_sq.device)
    for g in plain:
        total_sq += g.float().pow(2).sum().to(total_sq.device)
    total = total_sq.sqrt()
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        (g.to_local() if isinstance(g, DTensor) else g).mul_(scale.to(g.device))
    return total
