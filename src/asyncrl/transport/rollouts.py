"""Filesystem rollout transport: batch n lives in `RUN/rollouts/step_n/batch.safetensors`.

The writer builds the directory under a hidden temporary name in the same parent and renames it
into place, so a reader that sees `step_n/` always sees a complete batch (rename is atomic on
POSIX filesystems). The file is the `asyncrl.wire.encode_batch` layout in safetensors (numpy).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from asyncrl.wire import BatchFormatError, RolloutBatch, decode_batch, encode_batch

__all__ = ["BATCH_FILE", "RolloutTimeoutError", "batch_dir", "load_batch_file", "read_batch", "write_batch"]

BATCH_FILE = "batch.safetensors"
_POLL_S = 0.05


class RolloutTimeoutError(TimeoutError):
    """The batch for a step did not appear in time (is the orchestrator running and writing here?)."""


def batch_dir(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / "rollouts" / f"step_{step}"


def write_batch(run_dir: str | os.PathLike, batch: RolloutBatch) -> Path:
    """Write `batch` to rollouts/step_{batch.step}/ atomically; returns the final directory."""
    final = batch_dir(run_dir, batch.step)
    if final.exists():
        raise FileExistsError(f"{final} already exists: batch {batch.step} was written twice")
    arrays, meta = encode_batch(batch)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".step_{batch.step}.", dir=final.parent))
    try:
        save_file(arrays, str(tmp / BATCH_FILE), metadata=meta)
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
