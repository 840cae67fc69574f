"""Disk space in a run directory: one error that says what did not fit where, and a check before a write.

    check_free_space(path, need_bytes, "checkpoint")      # before a write of a known size
    with disk_full_as_error(path, "published weights"):  # ENOSPC / EDQUOT inside -> DiskFullError
        ...

`DiskFullError` is an `OSError` (errno ENOSPC) whose message names the path, what was being
written, the free space and, from the check, the size needed. A full disk reported by safetensors
(its own error type) becomes one too, so code that retries OS errors (the orchestrator's batch
writer) retries it as well. Torch-free.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError

__all__ = [
    "DiskFullError",
    "check_free_space",
    "disk_full_as_error",
    "disk_full_error",
    "format_bytes",
    "free_bytes",
    "is_disk_full",
]

_FULL = (errno.ENOSPC, errno.EDQUOT)
# safetensors reports an OS error as a SafetensorError that carries the errno only in its text
_SAFETENSORS_FULL = tuple(f"(os error {n})" for n in _FULL)


class DiskFullError(OSError):
    """The filesystem under a run directory cannot take a write (no space left, or over quota)."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return self.strerror


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def free_bytes(path: str | os.PathLike) -> int:
    """Free bytes on the filesystem that holds `path` (or would: its nearest existing ancestor)."""
    where = Path(path).absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    return shutil.disk_usage(where).free


def is_disk_full(e: BaseException) -> bool:
    if isinstance(e, SafetensorError):
        return any(code in str(e) for code in _SAFETENSORS_FULL)
    return isinstance(e, OSError) and e.errno in _FULL


def disk_full_error(path: str | os.PathLike, what: str, need_bytes: int | None = None) -> DiskFullError:
    """The error for `what` not fitting at `path`, with the free space now (and the size needed)."""
    needed = f", about {format_bytes(need_bytes)} needed" if need_bytes is not None else ""
    return DiskFullError(
        f"no space left for the {what} at {path}: {format_bytes(free_bytes(path))} free on its "
        f"filesystem{needed}. Free space (or keep fewer checkpoints / published weights), then "
        "continue the run with --resume"
    )


def check_free_space(path: str | os.PathLike, need_bytes: int, what: str) -> None:
    """Raise DiskFullError before writing `need_bytes` of `what` at `path` if they cannot fit."""
    if free_bytes(path) < need_bytes:
        raise disk_full_error(path, what, need_bytes)


@contextmanager
def disk_full_as_error(path: str | os.PathLike, what: str) -> Iterator[None]:
    """Turn a full disk or quota inside the block into a DiskFullError naming `what` and `path`."""
    try:
        yield
    except DiskFullError:
        raise
    except (OSError, SafetensorError) as e:
        if not is_disk_full(e):
            raise
        raise disk_full_error(path, what) from e
