"""Parallelism degrees of the trainer: `[trainer.parallel]` (torch-free; checked by asyncrl.distributed).

    [trainer.parallel]
    dp_shard = -1          # FSDP degree; -1 = whatever the world size leaves
    ep = 8                 # expert parallel: each rank holds num_experts / ep experts
    cp = 2                 # context parallel: each sequence split into 2 contiguous chunks
    activation_checkpointing = true

The product dp_replicate * dp_shard * cp must equal the world size, and ep borrows its ranks from
dp_shard * cp (it must divide that product and num_experts). `asyncrl.distributed.ParallelDims`
checks all of this against the model and world size before any process group is created.
"""

from __future__ import annotations

from pydantic import Field

from asyncrl.config.base import BaseConfig

__all__ = ["ParallelConfig"]


class ParallelConfig(BaseConfig):
    dp_replicate: int = Field(1, ge=1, description="HSDP replicas (gradients all-reduced across them)")
    dp_shard: int = Field(-1, ge=-1, description="FSDP degree within a replica; -1 = auto")
    ep: int = Field(1, ge=1, description="expert-parallel degree (divides num_experts and dp_shard*cp)")
    cp: int = Field(1, ge=1, description="context-parallel degree (contiguous sequence chunks)")
    activation_checkpointing: bool = Field(False, description="recompute each block in backward")
    reshard_after_forward: bool = Field(True, description="FSDP: free gathered weights after forward")
