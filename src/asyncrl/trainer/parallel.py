"""Data parallelism for the trainer: process group set-up and the all-reduces a step needs.

Launched by torchrun, each process reads RANK / WORLD_SIZE / LOCAL_RANK from the environment;
a plain `python -m` run is world size 1 and never touches torch.distributed. Gradients are
all-reduced with a sum (not a mean): the loss is already divided by the global count of loss
tokens, so the sum over ranks is the gradient of the global token mean. Under torchrun the
trainer shards the model with FSDP2 / EP / CP (scaleout.py) and FSDP reduces the gradients, so
`all_reduce_grads_` only runs at world size 1 (where it just fills missing gradients with zeros).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["DistInfo", "all_reduce_", "all_reduce_grads_", "barrier", "init_distributed"]


@dataclass(frozen=True, kw_only=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(device: str) -> DistInfo:
    """Initialise the default process group when WORLD_SIZE > 1 (NCCL on CUDA, gloo on CPU)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device(f"cuda:{local_rank}" if device == "cuda" else device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=dev)


def all_reduce_(tensor: torch.Tensor, info: DistInfo, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce (sum or max) over all ranks; a no-op at world size 1."""
    if info.is_distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return tensor


def all_reduce_grads_(params: Iterable[torch.nn.Parameter], info: DistInfo) -> None:
    """Sum gradients over ranks. Parameters without a gradient get zeros first, so every rank joins."""
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    if not info.is_distributed:
        return
    for g in grads:
        dist.all_reduce(g, op=dist.ReduceOp.SUM)


def barrier(info: DistInfo) -> None:
    if info.is_distributed:
        dist.barrier()
