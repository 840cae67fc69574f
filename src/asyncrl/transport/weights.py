"""Filesystem weight transport: policy version n lives in `RUN/weights/step_n/` with a STABLE marker.

The publisher (the trainer, which owns the torch side) writes files into a staging directory from
`stage_weights`; on a clean exit the directory is renamed to `step_n/` and then `STABLE` is
created inside it, so a watcher that sees `STABLE` sees a complete checkpoint. Only the newest
`keep_last` stable versions are kept. Watchers (the orchestrator) need only this module: no torch.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = [
    "STABLE_MARKER",
    "WeightsTimeoutError",
    "latest_stable_step",
    "prune_weights",
    "stable_steps",
    "stage_weights",
    "wait_for_weights",
    "weights_dir",
]

STABLE_MARKER = "STABLE"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_POLL_S = 0.05


class WeightsTimeoutError(TimeoutError):
    """A policy version was not published in time."""


def weights_dir(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / "weights" / f"step_{step}"


@contextmanager
def stage_weights(run_dir: str | os.PathLike, step: int, keep_last: int | None = None) -> Iterator[Path]:
    """Yield an empty staging directory; on success publish it as weights/step_{step}/ + STABLE.

    If the body raises, the staging directory is removed and nothing is published. An existing
    step_{step}/ (a re-run after resume) is replaced.
    """
    final = weights_dir(run_dir, step)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".step_{step}.", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            (final / STABLE_MARKER).unlink(missing_ok=True)
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (final / STABLE_MARKER).touch()
    if keep_last is not None:
        prune_weights(run_dir, keep_last)


def stable_steps(run_dir: str | os.PathLike) -> list[int]:
    """Published steps (those with STABLE), ascending."""
    root = Path(run_dir) / "weights"
    if not root.is_dir():
        return []
    steps = []
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and (child / STABLE_MARKER).is_file():
            steps.append(int(m[1]))
    return sorted(steps)


def latest_stable_step(run_dir: str | os.PathLike) -> int | None:
    steps = stable_steps(run_dir)
    return steps[-1] if steps else None


def prune_weights(run_dir: str | os.PathLike, keep_last: int) -> list[int]:
    """Delete all but the newest `keep_last` stable versions; returns the deleted steps."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    doomed = stable_steps(run_dir)[:-keep_last]
    for step in doomed:
        final = weights_dir(run_dir, step)
        # Remove the marker first so no watcher picks up a half-deleted directory.
        (final / STABLE_MARKER).unlink(missing_ok=True)
        shutil.rmtree(final, ignore_errors=True)
    return doomed


def wait_for_weights(run_dir: str | os.PathLike, step: int, timeout_s: float) -> Path:
    """Block until weights/step_{step}/STABLE exists; returns the directory."""
    final = weights_dir(run_dir, step)
    deadline = time.monotonic() + timeout_s
    while not (final / STABLE_MARKER).is_file():
        if time.monotonic() >= deadline:
            raise WeightsTimeoutError(
                f"weights for step {step} not published after {timeout_s:.0f}s: no {final / STABLE_MARKER}"
            )
        time.sleep(_POLL_S)
    return final
