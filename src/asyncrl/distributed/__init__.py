"""Scale-out training: parallel dims and meshes, FSDP2, expert parallel, context parallel, DCP.

Applied to an `asyncrl.model.Transformer` from outside; the model knows nothing about distribution.
See docs/scaling.md for the layout rules and how the trainer calls this package.
"""

from asyncrl.distributed.checkpoint import (
    gather_to_rank0,
    iter_hf_tensors,
    load_full_state_dict,
    load_model_dcp,
    save_model_dcp,
)
from asyncrl.distributed.context_parallel import (
    ContextParallelAttention,
    gather_from_cp,
    pad_for_cp,
    split_for_cp,
)
from asyncrl.distributed.dims import Meshes, ParallelDims, ParallelDimsError
from asyncrl.distributed.expert_parallel import ExpertParallelExperts, all_to_all, apply_expert_parallel
from asyncrl.distributed.parallelize import apply_parallelism, clip_grad_norm_, mixed_precision_policy

__all__ = [
    "ContextParallelAttention",
    "ExpertParallelExperts",
    "Meshes",
    "ParallelDims",
    "ParallelDimsError",
    "all_to_all",
    "apply_expert_parallel",
    "apply_parallelism",
    "clip_grad_norm_",
    "gather_from_cp",
    "gather_to_rank0",
    "iter_hf_tensors",
    "load_full_state_dict",
    "load_model_dcp",
    "mixed_precision_policy",
    "pad_for_cp",
    "save_model_dcp",
    "split_for_cp",
]
