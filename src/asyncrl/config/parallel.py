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

from typing import Literal

from pydantic import Field

from asyncrl.config.base import BaseConfig

__all__ = ["ParallelConfig", "SlurmConfig"]


class ParallelConfig(BaseConfig):
    dp_replicate: int = Field(1, ge=1, description="HSDP replicas (gradients all-reduced across them)")
    dp_shard: int = Field(-1, ge=-1, description="FSDP degree within a replica; -1 = auto")
    ep: int = Field(1, ge=1, description="expert-parallel degree (divides num_experts and dp_shard*cp)")
    cp: int = Field(1, ge=1, description="context-parallel degree (contiguous sequence chunks)")
    activation_checkpointing: bool = Field(False, description="recompute each block in backward")
    reshard_after_forward: bool = Field(True, description="FSDP: free gathered weights after forward")


class SlurmConfig(BaseConfig):
    """`[slurm]` of `asyncrl slurm @ rl.toml`: one sbatch job, inference nodes first, then trainer nodes.

    [slurm]
    inference_nodes = 2
    trainer_nodes = 4
    gpus_per_node = 8
    partition = "h200"
    time = "24:00:00"
    setup = ["source .venv/bin/activate"]
    env = { NCCL_IB_HCA = "mlx5" }
    """

    inference_nodes: int = Field(1, ge=1, description="nodes running inference servers")
    trainer_nodes: int = Field(1, ge=1, description="nodes running the trainer (torchrun)")
    gpus_per_node: int = Field(8, ge=1, description="GPUs per node (both groups)")
    servers_per_inference_node: int = Field(1, ge=1, description="GPUs of a node split evenly among them")
    job_name: str = Field("asyncrl", description="sbatch --job-name")
    partition: str | None = Field(None, description="sbatch --partition")
    account: str | None = Field(None, description="sbatch --account")
    time: str | None = Field(None, description="Slurm time limit, e.g. '24:00:00'")
    rdzv_port: int = Field(29500, ge=1, le=65535, description="torchrun c10d rendezvous port")
    orchestrator_on: Literal["trainer", "inference"] = Field(
        "trainer", description="which node group's first node runs the orchestrator (CPU only)"
    )
    python: str = Field("python", description="interpreter that runs `-m asyncrl` on the nodes")
    setup: list[str] = Field(default_factory=list, description="shell lines run first on every node")
    env: dict[str, str] = Field(default_factory=dict, description="exported to every process")
    extra_sbatch: list[str] = Field(
        default_factory=list, description="more '#SBATCH' options, e.g. '--qos=high'"
    )
