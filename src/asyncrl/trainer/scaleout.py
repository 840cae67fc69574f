"""The trainer's parallel step: FSDP2 / expert parallel / context parallel, built on asyncrl.distributed.

Process groups, meshes, sharding and collectives live in `asyncrl.distributed`; this module is
what the trainer adds: building its model from the config, and preparing each step's micro-batches.
World size 1 never comes here: the session loads a plain model and the step runner runs as before.
Under torchrun (WORLD_SIZE > 1) the session does, in this order (docs/scaling.md):

    dims = resolve_dims(cfg.parallel, cfg.model.path)   # before init_process_group: bad dims fail early
    info = init_distributed(cfg.model.device)           # asyncrl.distributed
    model, state = build_parallel_model(cfg, dims, info)  # meta -> apply_parallelism -> own slices

and per step the step runner calls `equalize_micro_batches` (every rank runs the same number of
forwards, or FSDP / EP / CP collectives hang) and `split_for_rank` (this rank's CP chunk of every
per-token stream, with the attention backend that sees the whole row).

Shape legend: T tokens of the full packed row, Tc tokens of this rank's CP chunk, L layers,
K top_k.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from asyncrl.config.parallel import ParallelConfig
from asyncrl.config.trainer import CommonTrainConfig
from asyncrl.distributed import (
    ContextParallelAttention,
    DistInfo,
    Meshes,
    ParallelDims,
    apply_parallelism,
    load_hf_shards,
    pad_for_cp,
    split_for_cp,
)
from asyncrl.model import AttentionBackend, Transformer, load_args, torch_dtype
from asyncrl.model.hf import HFReader, build_meta_model
from asyncrl.trainer.packing import MicroBatch

__all__ = [
    "LocalMicroBatch",
    "ParallelState",
    "build_parallel_model",
    "equalize_micro_batches",
    "resolve_dims",
    "split_for_rank",
]

# MicroBatch streams split along the tokens: name -> (dim, pad value).
_ROW_STREAMS = {"input_ids": (1, 0), "position_ids": (1, 0), "routed_experts": (1, 0)}
_TOKEN_STREAMS = {
    "target_ids": 0,
    "loss_mask": False,
    "inference_logprobs": 0.0,
    "advantages": 0.0,
    "temperatures": 1.0,
    "policy_versions": 0,
    "context_versions": 0,
    "seq_ids": 0,
}


@dataclass(frozen=True, kw_only=True)
class ParallelState:
    """This rank's place in the parallel layout."""

    dims: ParallelDims
    meshes: Meshes
    rank: int

    @property
    def dp_rank(self) -> int:
        return self.dims.dp_rank(self.rank)

    @property
    def cp_rank(self) -> int:
        return self.dims.cp_rank(self.rank)

    @property
    def cp_group(self) -> dist.ProcessGroup:
        return self.meshes.world.get_group("cp")


@dataclass(frozen=True, kw_only=True)
class LocalMicroBatch:
    """What one rank runs for a micro-batch: its chunk, the attention backend, and token statistics."""

    mb: MicroBatch  # this rank's chunk (the whole row when cp = 1)
    attention: AttentionBackend | None  # None: the model's own packed attention
    num_tokens: int  # real (unpadded) tokens in the chunk
    context: float  # sum over real tokens of the keys each attends to (position + 1)


def resolve_dims(cfg: ParallelConfig, model_path: os.PathLike | str) -> ParallelDims:
    """Validate `[trainer.parallel]` against WORLD_SIZE and the model; needs no process group."""
    args = load_args(model_path)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return ParallelDims.from_config(
        cfg, world_size=world_size, num_experts=args.num_experts if args.is_moe else 0
    )


def build_parallel_model(
    cfg: CommonTrainConfig, dims: ParallelDims, info: DistInfo
) -> tuple[Transformer, ParallelState]:
    """Meshes, the model built on meta and parallelised, then each rank reads its own slices of the files.

    No rank ever holds the full model: every parameter and buffer is filled with just this rank's
    shard, read straight from the safetensors files (`asyncrl.distributed.load_hf_shards`). MTP
    layers are frozen and sharded like the weights (docs/trainer.md).
    """
    meshes = dims.build_meshes(info.device.type)
    with HFReader(cfg.model.path, load_args(cfg.model.path)) as reader:
        model = build_meta_model(reader, torch_dtype(cfg.model.dtype))
        apply_parallelism(
            model,
            dims,
            meshes,
            device_type=info.device.type,
            activation_checkpointing=cfg.parallel.activation_checkpointing,
            reshard_after_forward=cfg.parallel.reshard_after_forward,
        )
        model.to_empty(device=info.device)
        model.tie_weights()
        load_hf_shards(model, reader, where=str(cfg.model.path))
    model.train()
    return model, ParallelState(dims=dims, meshes=meshes, rank=info.rank)


def _empty_micro_batch(num_tokens: int, device: torch.device) -> MicroBatch:
    """An all-masked row: runs every collective of a forward/backward and contributes nothing."""
    zeros_T = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    return MicroBatch(
        input_ids=zeros_T.unsqueeze(0),
        position_ids=torch.arange(num_tokens, device=device).unsqueeze(0),
        target_ids=zeros_T,
        loss_mask=torch.zeros(num_tokens, dtype=torch.bool, device=device),
        inference_logprobs=torch.zeros(num_tokens, device=device),
        advantages=torch.zeros(num_tokens, device=device),
        temperatures=torch.ones(num_tokens, device=device),
        policy_versions=zeros_T,
        context_versions=zeros_T,
        seq_ids=zeros_T,
        routed_experts=None,
        num_sequences=0,
    )


def equalize_micro_batches(
    micro_batches: list[MicroBatch], state: ParallelState, device: torch.device
) -> list[MicroBatch]:
    """Pad with all-masked rows up to the largest micro-batch count over all ranks."""
    count = torch.tensor([len(micro_batches)], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    missing = int(count[0]) - len(micro_batches)
    return micro_batches + [_empty_micro_batch(state.dims.cp, device) for _ in range(missing)]


def split_for_rank(mb: MicroBatch, state: ParallelState) -> LocalMicroBatch:
    """This rank's contiguous CP chunk of every stream; with cp = 1 the row itself."""
    real = mb.num_tokens if mb.num_sequences else 0
    cp = state.dims.cp
    if cp == 1:
        return LocalMicroBatch(
            mb=mb, attention=None, num_tokens=real, context=float((mb.position_ids[0, :real] + 1).sum())
        )
    fields = {}
    for name, (dim, value) in _ROW_STREAMS.items():
        x = getattr(mb, name)
        fields[name] = None if x is None else pad_for_cp(x, cp, dim, value)
    for name, value in _TOKEN_STREAMS.items():
        fields[name] = pad_for_cp(getattr(mb, name), cp, 0, value)
    attention = ContextParallelAttention(fields["position_ids"], state.cp_group)
    Tc = fields["input_ids"].shape[1] // cp
    start = state.cp_rank * Tc
    local_real = max(0, min(real - start, Tc))
    for name, (dim, _) in _ROW_STREAMS.items():
        if fields[name] is not None:
            fields[name] = split_for_cp(fields[name], cp, state.cp_rank, dim)
    for name in _TOKEN_STREAMS:
        fields[name] = split_for_cp(fields[name], cp, state.cp_rank, 0)
    local = replace(mb, **fields)
    context = float((local.position_ids[0, :local_real] + 1).sum())
    return LocalMicroBatch(mb=local, attention=attention, num_tokens=local_real, context=context)
