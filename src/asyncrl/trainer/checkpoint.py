"""Full training-state checkpoints: which steps a run holds, and the trainer's own entries.

`RUN/checkpoints/step_n/` holds model, optimizer, scheduler, RNG and step. Model and optimizer
go through the one DCP save/load (`asyncrl.distributed.save_dcp` / `load_dcp`, which reshard to
any world size); this module adds the "trainer" entry (step, scheduler, RNG), and `metrics.json`,
the step's metrics line as the main rank logs it (`checkpoint_metrics` reads it: a trainer killed
after the checkpoint and before the line writes the line on resume). The directory is
written under a temporary name and renamed when complete; `latest_checkpoint_step` only sees
complete ones. A checkpoint that does not fit (too little free space for the model and optimizer
bytes, checked before writing, or a full disk while writing) raises `DiskFullError` on every rank
and leaves no temporary directory behind. Works without a process group (single process).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from asyncrl.distributed import DistInfo, barrier, load_dcp, save_dcp
from asyncrl.run_dir import checkpoint_dir, checkpoint_steps, latest_checkpoint_step
from asyncrl.trainer.diskspace import raise_together, state_bytes
from asyncrl.transport.disk import (
    DiskFullError,
    check_free_space,
    disk_full_as_error,
    disk_full_error,
    is_disk_full,
)

__all__ = [
    "CheckpointNotFoundError",
    "checkpoint_metrics",
    "checkpoint_steps",
    "latest_checkpoint_step",
    "load_checkpoint",
    "save_checkpoint",
]


_METRICS_FILE = "metrics.json"


class CheckpointNotFoundError(ValueError):
    """--resume / --resume-step asked for a checkpoint that does not exist."""


def _trainer_entry(step: int, scheduler_json: str) -> dict[str, Any]:
    """What the trainer adds to model + optimizer (also the template DCP fills on load)."""
    trainer: dict[str, Any] = {"step": step, "scheduler": scheduler_json, "rng_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        trainer["rng_cuda"] = torch.cuda.get_rng_state()
    return trainer


def save_checkpoint(
    run_dir: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    info: DistInfo,
    keep_last: int,
    metrics: Mapping[str, Any] | None = None,
) -> Path:
    """Write the checkpoint of `step` on every rank; the main rank's `metrics` are stored with it."""
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(f".{final.name}.tmp")
    what = f"checkpoint of step {step}"
    error = _make_tmp(tmp, final, state_bytes(model, optimizer), what, metrics) if info.is_main else None
    raise_together(error, info)  # a barrier too: every rank finds the directory
    trainer = _trainer_entry(step, json.dumps(scheduler.state_dict()))
    try:
        save_dcp(tmp, model, optimizer, extra={"trainer": trainer})
    except (CheckpointException, OSError) as e:  # DCP raises on every rank when one fails
        if info.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        if _is_disk_full(e):
            raise disk_full_error(final, what) from e
        raise
    barrier(info)
    if info.is_main:
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for old in checkpoint_steps(run_dir)[:-keep_last]:
            shutil.rmtree(checkpoint_dir(run_dir, old), ignore_errors=True)
    barrier(info)
    return final


def _make_tmp(
    tmp: Path, final: Path, need_bytes: int, what: str, metrics: Mapping[str, Any] | None
) -> DiskFullError | None:
    """Rank 0: the temporary directory (with `metrics`) if `need_bytes` fit, else the error to raise
    everywhere."""
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        check_free_space(final, need_bytes, what)
        with disk_full_as_error(final, what):
            tmp.mkdir(parents=True)
            if metrics is not None:
                (tmp / _METRICS_FILE).write_text(json.dumps(dict(metrics)))
    except DiskFullError as e:
        return e
    return None


def checkpoint_metrics(run_dir: Path, step: int) -> dict[str, Any] | None:
    """The metrics record stored with the checkpoint of `step`; None for a checkpoint without one."""
    path = checkpoint_dir(run_dir, step) / _METRICS_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _is_disk_full(e: BaseException) -> bool:
    if isinstance(e, CheckpointException):
        return any(is_disk_full(failure) for failure, _ in e.failures.values())
    return is_disk_full(e)


def load_checkpoint(
    run_dir: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> int:
    """Restore everything saved at `step` in place; returns the step."""
    path = checkpoint_dir(run_dir, step)
    if not (path / ".metadata").is_file():
        have = checkpoint_steps(run_dir)
        raise CheckpointNotFoundError(f"no complete checkpoint at {path}; available steps: {have or 'none'}")
    trainer = load_dcp(path, model, optimizer, extra={"trainer": _trainer_entry(0, "")})["trainer"]
    scheduler.load_state_dict(json.loads(trainer["scheduler"]))
    torch.set_rng_state(trainer["rng_cpu"])
    if "rng_cuda" in trainer:
        torch.cuda.set_rng_state(trainer["rng_cuda"])
    return int(trainer["step"])
