"""Filesystem rollout transport: batch n lives in `RUN/rollouts/step_n/batch.safetensors`.

The writer builds the directory under a hidden temporary name in the same parent and renames it
into place, so a reader that sees `step_n/` always sees a complete batch (rename is atomic on
POSIX filesystems). The file is the `asyncrl.wire.encode_batch` layout in safetensors (numpy).
A writer may attach more safetensors files to the same directory (the orchestrator attaches its
checkpoint): they appear with the batch, in the same rename, or not at all.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from asyncrl.run_dir import batch_dir, rollouts_root, step_name, steps_in
from asyncrl.transport.disk import disk_full_as_error
from asyncrl.wire import BatchFormatError, RolloutBatch, decode_batch, encode_batch

__all__ = [
    "BATCH_FILE",
    "Attachment",
    "RolloutTimeoutError",
    "batch_steps",
    "load_batch_file",
    "read_batch",
    "write_batch",
]

BATCH_FILE = "batch.safetensors"
_POLL_S = 0.05

# file name -> (arrays, string metadata) of one more safetensors file in the batch directory
Attachment = Mapping[str, tuple[dict[str, np.ndarray], dict[str, str]]]


class RolloutTimeoutError(TimeoutError):
    """The batch for a step did not appear in time (is the orchestrator running and writing here?)."""


def batch_steps(run_dir: str | os.PathLike) -> list[int]:
    """Steps whose batch directory exists (complete, since it appears by rename), ascending."""
    return steps_in(rollouts_root(run_dir))


def write_batch(
    run_dir: str | os.PathLike, batch: RolloutBatch, attachments: Attachment | None = None
) -> Path:
    """Write `batch` (and `attachments`) to rollouts/step_{batch.step}/ atomically; returns the directory.

    Raises OSError with nothing left behind if the disk refuses the write: `DiskFullError` (naming
    the batch, the path and the free space) when it is full.
    """
    final = batch_dir(run_dir, batch.step)
    if final.exists():
        raise FileExistsError(f"{final} already exists: batch {batch.step} was written twice")
    arrays, meta = encode_batch(batch)
    files = {BATCH_FILE: (arrays, meta)} | dict(attachments or {})
    with disk_full_as_error(final, f"batch of step {batch.step}"):
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{step_name(batch.step)}.", dir=final.parent))
        try:
            for name, (file_arrays, file_meta) in files.items():
                save_file(file_arrays, str(tmp / name), metadata=file_meta)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def read_batch(run_dir: str | os.PathLike, step: int, timeout_s: float = 600.0) -> RolloutBatch:
    """Wait up to `timeout_s` for rollouts/step_{step}/, then decode it.

    Raises RolloutTimeoutError if it never appears, and BatchFormatError naming the file and the
    field if it is malformed.
    """
    final = batch_dir(run_dir, step)
    deadline = time.monotonic() + timeout_s
    while not final.is_dir():
        if time.monotonic() >= deadline:
            raise RolloutTimeoutError(
                f"no rollout batch for step {step} after {timeout_s:.0f}s: {final} does not exist "
                "(is the orchestrator running with the same run_dir?)"
            )
        time.sleep(_POLL_S)
    return load_batch_file(final / BATCH_FILE, expected_step=step)


def load_batch_file(path: Path, expected_step: int | None = None) -> RolloutBatch:
    """Decode one batch file, with errors that name the file."""
    if not path.is_file():
        raise BatchFormatError(f"{path}: missing batch file (expected {BATCH_FILE} in the step directory)")
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = dict(f.metadata() or {})
            arrays = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (not a mapping)
    except (SafetensorError, OSError) as e:
        raise BatchFormatError(f"{path}: not a readable safetensors file ({e})") from None
    batch = decode_batch(arrays, meta, where=str(path))
    if expected_step is not None and batch.step != expected_step:
        raise BatchFormatError(f"{path}: metadata 'step' is {batch.step}, expected {expected_step}")
    return batch
