"""Disk space for the trainer's large writes (checkpoints, published weights), decided by all ranks at once.

Before a write, rank 0 compares the free space under the run directory with the write's size: for
a checkpoint the bytes of the full parameters plus the optimizer state (`state_bytes`), for
published weights the bytes of their files in the serving format (`asyncrl.model.hf.FilePlan`,
half the fp32 parameters' bytes in bf16) plus the tokenizer files.
A rank that cannot write shares that with the others (`raise_together`), so every rank raises
`DiskFullError` and none is left waiting in a collective. `asyncrl trainer` / `asyncrl sft` print
the error's one line and exit 1.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

import torch

from asyncrl.distributed import DistInfo, all_reduce_
from asyncrl.transport import DiskFullError, check_free_space

__all__ = ["ensure_free_space", "raise_together", "report_disk_full", "state_bytes"]


def _num_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)  # a DTensor counts its full shape


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes of the full parameters, plus the optimizer's state tensors if given."""
    total = _num_bytes(model.parameters())
    if optimizer is not None:
        states = optimizer.state.values()
        total += _num_bytes(v for state in states for v in state.values() if isinstance(v, torch.Tensor))
    return total


def raise_together(error: DiskFullError | None, info: DistInfo) -> None:
    """Raise on every rank if any rank has `error`; collective (a no-op at world size 1)."""
    flag = torch.tensor([0.0 if error is None else 1.0], device=info.device)
    all_reduce_(flag, info, "max")
    if error is None and flag.item():
        error = DiskFullError("another rank could not write to a full disk (rank 0 names the path)")
    if error is not None:
        raise error


def ensure_free_space(path: str | os.PathLike, need_bytes: int, what: str, info: DistInfo) -> None:
    """Raise DiskFullError on every rank unless `need_bytes` of `what` fit at `path` (rank 0 checks)."""
    error = None
    if info.is_main:
        try:
            check_free_space(path, need_bytes, what)
        except DiskFullError as e:
            error = e
    raise_together(error, info)


def report_disk_full(program: str, error: DiskFullError) -> int:
    """Print `error` as one line (once: rank 0 under torchrun); returns the exit code, 1."""
    if os.environ.get("RANK", "0") == "0":
        print(f"{program}: {error}", file=sys.stderr, flush=True)
    return 1
