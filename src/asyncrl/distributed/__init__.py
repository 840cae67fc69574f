"""Scale-out training: process groups, parallel dims and meshes, FSDP2, EP, CP, DCP.

Applied to an `asyncrl.model.Transformer` from outside; the model knows nothing about distribution.
See docs/scaling.md for the layout rules and how the trainer calls this package.

The names below load their module on first use: `ParallelDims` imports without torch (the
launcher checks a layout before it starts anything).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncrl.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "checkpoint": (
            "gather_to_rank",
            "gather_to_rank0",
            "iter_full_tensors",
            "iter_hf_tensors",
            "load_dcp",
            "load_full_state_dict",
            "save_dcp",
        ),
        "context_parallel": ("ContextParallelAttention", "gather_from_cp", "pad_for_cp", "split_for_cp"),
        "dims": ("Meshes", "ParallelDims", "ParallelDimsError"),
        "expert_parallel": ("ExpertParallelExperts", "all_to_all", "apply_expert_parallel"),
        "hf_load": ("load_hf_shards", "local_index"),
        "parallelize": ("apply_parallelism", "clip_grad_norm_", "mixed_precision_policy"),
        "process_group": ("DistInfo", "all_reduce_", "barrier", "init_distributed"),
    },
)

__all__ = [
    "ContextParallelAttention",
    "DistInfo",
    "ExpertParallelExperts",
    "Meshes",
    "ParallelDims",
    "ParallelDimsError",
    "all_reduce_",
    "all_to_all",
    "apply_expert_parallel",
    "apply_parallelism",
    "barrier",
    "clip_grad_norm_",
    "gather_from_cp",
    "gather_to_rank",
    "gather_to_rank0",
    "init_distributed",
    "iter_full_tensors",
    "iter_hf_tensors",
    "load_dcp",
    "load_full_state_dict",
    "load_hf_shards",
    "local_index",
    "mixed_precision_policy",
    "pad_for_cp",
    "save_dcp",
    "split_for_cp",
]

if TYPE_CHECKING:  # what type checkers and editors see
    from asyncrl.distributed.checkpoint import (
        gather_to_rank,
        gather_to_rank0,
        iter_full_tensors,
        iter_hf_tensors,
        load_dcp,
        load_full_state_dict,
        save_dcp,
    )
    from asyncrl.distributed.context_parallel import (
        ContextParallelAttention,
        gather_from_cp,
        pad_for_cp,
        split_for_cp,
    )
    from asyncrl.distributed.dims import Meshes, ParallelDims, ParallelDimsError
    from asyncrl.distributed.expert_parallel import ExpertParallelExperts, all_to_all, apply_expert_parallel
    from asyncrl.distributed.hf_load import load_hf_shards, local_index
    from asyncrl.distributed.parallelize import apply_parallelism, clip_grad_norm_, mixed_precision_policy
    from asyncrl.distributed.process_group import DistInfo, all_reduce_, barrier, init_distributed
