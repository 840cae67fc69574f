"""Process group set-up and the few collectives every rank's caller needs.

Launched by torchrun, each process reads RANK / WORLD_SIZE / LOCAL_RANK from the environment; a
plain `python -m` run is world size 1 and never touches torch.distributed (every helper here is
then a no-op).

    info = init_distributed("auto")     # NCCL on CUDA, gloo on CPU; DistInfo(rank, world_size, ...)
    all_reduce_(count, info)            # sum (or op="max") over all ranks, in place
    barrier(info)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from asyncrl.model.devices import resolve_device

__all__ = ["DistInfo", "all_reduce_", "barrier", "init_distributed"]


@dataclass(frozen=True, kw_only=True)
class DistInfo:
    """This process's place in the world. Example: DistInfo(rank=0, world_size=1, local_rank=0,
    device=torch.device("cpu")) is a single-process run."""

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
    """Initialise the default process group when WORLD_SIZE > 1 (NCCL on CUDA, gloo on CPU).

    `device` is a config's "auto", "cpu" or "cuda"; a CUDA rank uses cuda:LOCAL_RANK."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=dev)


def all_reduce_(tensor: torch.Tensor, info: DistInfo, op: Literal["sum", "max"] = "sum") -> torch.Tensor:
    """In-place all-reduce (sum or max) over all ranks; a no-op at world size 1."""
    if op not in ("sum", "max"):
        raise ValueError(f"all_reduce_ op must be 'sum' or 'max', got {op!r}")
    if info.is_distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return tensor


def barrier(info: DistInfo) -> None:
    if info.is_distributed:
        dist.barrier()
