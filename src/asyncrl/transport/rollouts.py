"""Filesystem rollout transport: batch n lives in `RUN/rollouts/step_n/`, one part per trainer data rank.

    rollouts/step_n/
      manifest.json             step, metrics, every sample's tokens and reward, each part's samples
      part_0.safetensors        data rank 0's samples (the `asyncrl.wire.encode_batch` layout)
      part_1.safetensors        ...; an empty part has no file
      orchestrator.safetensors  an attachment (the orchestrator's checkpoint)

    write_batch(run_dir, batch, num_parts=4)                  # orchestrator: 4 token-balanced parts
    share = read_batch_part(run_dir, n, rank=1, num_ranks=4)  # trainer data rank 1: part_1 only
    batch = read_batch(run_dir, n)                            # every part, samples in batch order

The parts are `asyncrl.wire.split_by_tokens(lengths, num_parts)`, so part r holds exactly the
samples a trainer reading the whole batch would give data rank r. A trainer with another number of
data ranks (a resume at another layout) splits the manifest's lengths for its own count, reads its
samples out of the parts that hold them (only their tokens, through safetensors' lazy slices), and
warns. A step directory written before batches were split holds
one `batch.safetensors` and no manifest; it reads as a batch of one part.

The writer builds the directory under a hidden temporary name in the same parent and renames it
into place, so a reader that sees `step_n/` always sees a complete batch (rename is atomic on
POSIX filesystems). Attachments (more safetensors files) appear with the batch, in the same
rename, or not at all.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from asyncrl.run_dir import batch_dir, rollouts_root, step_name, steps_in
from asyncrl.transport.disk import disk_full_as_error
from asyncrl.wire import (
    BatchFormatError,
    RolloutBatch,
    RolloutSample,
    decode_batch,
    encode_batch,
    select_encoded,
    split_by_tokens,
)

__all__ = [
    "LEGACY_BATCH_FILE",
    "MANIFEST_FILE",
    "Attachment",
    "BatchManifest",
    "BatchShare",
    "RolloutTimeoutError",
    "batch_steps",
    "load_batch_file",
    "part_file",
    "read_batch",
    "read_batch_part",
    "read_manifest",
    "write_batch",
]

MANIFEST_FILE = "manifest.json"
LEGACY_BATCH_FILE = "batch.safetensors"  # the single-file layout, read as one part
_FORMAT = 1
_POLL_S = 0.05

# file name -> (arrays, string metadata) of one more safetensors file in the batch directory
Attachment = Mapping[str, tuple[dict[str, np.ndarray], dict[str, str]]]


class RolloutTimeoutError(TimeoutError):
    """The batch for a step did not appear in time (is the orchestrator running and writing here?)."""


def part_file(part: int) -> str:
    """The name of part `part`'s file in a step directory."""
    return f"part_{part}.safetensors"


@dataclass(frozen=True, kw_only=True)
class BatchManifest:
    """A batch directory's table of contents: everything about the batch but its token arrays.

    Example (3 samples in 2 parts; part 0 holds sample 0, part 1 samples 1 and 2)::

        BatchManifest(step=3, lengths=[120, 80, 40], rewards=[1.0, 0.0, 1.0],
                      parts=[[0], [1, 2]], files=["part_0.safetensors", "part_1.safetensors"],
                      part_bytes=[5120, 5200], metrics={"reward/mean": 0.67})
    """

    step: int
    lengths: list[int]  # tokens of each sample, in batch order
    rewards: list[float]  # reward of each sample, in batch order
    parts: list[list[int]]  # batch indices of each part's samples, ascending
    files: list[str | None]  # each part's file in the step directory (None: an empty part)
    part_bytes: list[int]  # each part file's size
    metrics: dict[str, float]
    num_bytes_read: int = 0  # bytes read to list the batch (the manifest, or a whole single-file batch)

    @property
    def num_samples(self) -> int:
        return len(self.lengths)

    @property
    def num_parts(self) -> int:
        return len(self.parts)

    @property
    def num_bytes(self) -> int:
        """The whole batch's bytes on disk (every part)."""
        return sum(self.part_bytes)


@dataclass(frozen=True, kw_only=True)
class BatchShare:
    """One data rank's samples of a batch, the batch's manifest, and what reading them cost."""

    batch: RolloutBatch  # this rank's samples in batch order (possibly none), the batch's step and metrics
    manifest: BatchManifest
    num_bytes_read: int  # the manifest and every part file this rank read


def batch_steps(run_dir: str | os.PathLike) -> list[int]:
    """Steps whose batch directory exists (complete, since it appears by rename), ascending."""
    return steps_in(rollouts_root(run_dir))


# -- writing -------------------------------------------------------------------------------------
def write_batch(
    run_dir: str | os.PathLike,
    batch: RolloutBatch,
    attachments: Attachment | None = None,
    *,
    num_parts: int = 1,
) -> Path:
    """Write `batch` in `num_parts` token-balanced parts (and `attachments`) to rollouts/step_{batch.step}/
    atomically; returns the directory.

    Raises OSError with nothing left behind if the disk refuses the write: `DiskFullError` (naming
    the batch, the path and the free space) when it is full.
    """
    final = batch_dir(run_dir, batch.step)
    if final.exists():
        raise FileExistsError(f"{final} already exists: batch {batch.step} was written twice")
    if not batch.samples:
        raise BatchFormatError(f"batch for step {batch.step} has no samples")
    parts = split_by_tokens([s.num_tokens for s in batch.samples], num_parts)
    clash = ({part_file(r) for r in range(num_parts)} | {MANIFEST_FILE}) & set(attachments or {})
    assert not clash, f"attachments may not take the batch's own file names {sorted(clash)}"
    with disk_full_as_error(final, f"batch of step {batch.step}"):
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{step_name(batch.step)}.", dir=final.parent))
        try:
            for r, idx in enumerate(parts):  # one part encoded at a time: at most a part's copy in memory
                if idx:
                    part = RolloutBatch(
                        step=batch.step, samples=[batch.samples[i] for i in idx], metrics=batch.metrics
                    )
                    arrays, meta = encode_batch(part)
                    save_file(arrays, str(tmp / part_file(r)), metadata=meta)
            for name, (arrays, meta) in (attachments or {}).items():
                save_file(arrays, str(tmp / name), metadata=meta)
            (tmp / MANIFEST_FILE).write_text(json.dumps(_manifest_doc(batch, parts, tmp)))
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def _manifest_doc(batch: RolloutBatch, parts: list[list[int]], where: Path) -> dict[str, Any]:
    sizes = [(where / part_file(r)).stat().st_size if idx else 0 for r, idx in enumerate(parts)]
    return {
        "format": _FORMAT,
        "step": batch.step,
        "lengths": [s.num_tokens for s in batch.samples],
        "rewards": [s.reward for s in batch.samples],
        "parts": parts,
        "part_bytes": sizes,
        "metrics": batch.metrics,
    }


# -- reading -------------------------------------------------------------------------------------
def read_manifest(run_dir: str | os.PathLike, step: int, timeout_s: float = 600.0) -> BatchManifest:
    """Wait up to `timeout_s` for rollouts/step_{step}/, then read its manifest only."""
    return _open_batch(_wait_for_batch(run_dir, step, timeout_s), step)[0]


def read_batch(run_dir: str | os.PathLike, step: int, timeout_s: float = 600.0) -> RolloutBatch:
    """Wait up to `timeout_s` for rollouts/step_{step}/, then decode every part into one batch.

    Raises RolloutTimeoutError if it never appears, and BatchFormatError naming the file and the
    field if it is malformed.
    """
    d = _wait_for_batch(run_dir, step, timeout_s)
    manifest, loaded = _open_batch(d, step)
    samples, _ = _read_samples(d, manifest, loaded, range(manifest.num_samples))
    return RolloutBatch(step=step, samples=samples, metrics=manifest.metrics)


def read_batch_part(
    run_dir: str | os.PathLike, step: int, *, rank: int, num_ranks: int, timeout_s: float = 600.0
) -> BatchShare:
    """Data rank `rank` of `num_ranks`: wait for batch `step`, then read its own part only.

    A batch written in another number of parts is split again for `num_ranks` from the manifest's
    lengths (the same split, so the same samples as reading it whole); this rank then reads its
    samples out of the parts that hold them (only their tokens), with a warning.
    """
    assert 0 <= rank < num_ranks, (rank, num_ranks)
    d = _wait_for_batch(run_dir, step, timeout_s)
    manifest, loaded = _open_batch(d, step)
    if num_ranks == manifest.num_parts:
        wanted = manifest.parts[rank]
    else:
        wanted = split_by_tokens(manifest.lengths, num_ranks)[rank]
    samples, num_bytes = _read_samples(d, manifest, loaded, wanted)
    num_bytes_read = manifest.num_bytes_read + num_bytes
    if num_ranks != manifest.num_parts:
        warnings.warn(
            f"{d} holds {manifest.num_parts} part(s), one per data rank of the trainer it was written for, "
            f"but this trainer has {num_ranks}: data rank {rank} read its samples out of them "
            f"({num_bytes_read} of the batch's {manifest.num_bytes} bytes), the ones it would get from "
            "the whole batch. The orchestrator writes a batch in [orchestrator] trainer_dp_size parts "
            "(under `asyncrl rl`: the trainer's data ranks)",
            stacklevel=2,
        )
    batch = RolloutBatch(step=step, samples=samples, metrics=manifest.metrics)
    return BatchShare(batch=batch, manifest=manifest, num_bytes_read=num_bytes_read)


def _wait_for_batch(run_dir: str | os.PathLike, step: int, timeout_s: float) -> Path:
    final = batch_dir(run_dir, step)
    deadline = time.monotonic() + timeout_s
    while not final.is_dir():
        if time.monotonic() >= deadline:
            raise RolloutTimeoutError(
                f"no rollout batch for step {step} after {timeout_s:.0f}s: {final} does not exist "
                "(is the orchestrator running with the same run_dir?)"
            )
        time.sleep(_POLL_S)
    return final


def _open_batch(d: Path, step: int) -> tuple[BatchManifest, dict[int, RolloutBatch]]:
    """The manifest of step directory `d`, and the parts decoded on the way: a single-file batch
    has no manifest, so it is read whole to list its samples."""
    if (d / MANIFEST_FILE).is_file():
        return _load_manifest(d / MANIFEST_FILE, step), {}
    if (d / LEGACY_BATCH_FILE).is_file():
        path = d / LEGACY_BATCH_FILE
        batch = load_batch_file(path, expected_step=step)
        size = path.stat().st_size
        manifest = BatchManifest(
            step=step,
            lengths=[s.num_tokens for s in batch.samples],
            rewards=[s.reward for s in batch.samples],
            parts=[list(range(len(batch.samples)))],
            files=[LEGACY_BATCH_FILE],
            part_bytes=[size],
            metrics=batch.metrics,
            num_bytes_read=size,
        )
        return manifest, {0: batch}
    raise BatchFormatError(
        f"{d}: missing {MANIFEST_FILE} (and no {LEGACY_BATCH_FILE} of the single-file layout): not a "
        "batch directory written by asyncrl"
    )


def _load_manifest(path: Path, step: int) -> BatchManifest:
    text = path.read_bytes()
    try:
        doc = json.loads(text)
        manifest = BatchManifest(
            step=int(doc["step"]),
            lengths=[int(n) for n in doc["lengths"]],
            rewards=[float(r) for r in doc["rewards"]],
            parts=[[int(i) for i in idx] for idx in doc["parts"]],
            files=[part_file(r) if idx else None for r, idx in enumerate(doc["parts"])],
            part_bytes=[int(n) for n in doc["part_bytes"]],
            metrics=dict(doc["metrics"]),
            num_bytes_read=len(text),
        )
    except (ValueError, KeyError, TypeError) as e:
        raise BatchFormatError(f"{path}: not a batch manifest ({e!r})") from None
    if doc.get("format") != _FORMAT:
        raise BatchFormatError(f"{path}: manifest format {doc.get('format')}, this version reads {_FORMAT}")
    if manifest.step != step:
        raise BatchFormatError(f"{path}: 'step' is {manifest.step}, expected {step}")
    n = manifest.num_samples
    listed = sorted(i for idx in manifest.parts for i in idx)
    if (
        listed != list(range(n))
        or len(manifest.rewards) != n
        or len(manifest.part_bytes) != manifest.num_parts
    ):
        raise BatchFormatError(
            f"{path}: 'parts' must list each of the {n} samples once, with one reward per sample and "
            "one size per part"
        )
    return manifest


def _read_samples(
    d: Path, manifest: BatchManifest, loaded: dict[int, RolloutBatch], wanted: Iterable[int]
) -> tuple[list[RolloutSample], int]:
    """The samples at batch indices `wanted`, in that order, and the bytes read for them: a part
    whose samples are all wanted is read whole, any other only over the wanted samples' tokens."""
    where = {i: (part, pos) for part, idx in enumerate(manifest.parts) for pos, i in enumerate(idx)}
    wanted = list(wanted)
    by_part: dict[int, list[int]] = {}
    for i in wanted:
        by_part.setdefault(where[i][0], []).append(where[i][1])
    got: dict[tuple[int, int], RolloutSample] = {}
    num_bytes = 0
    for part, positions in by_part.items():
        if part not in loaded and len(positions) == len(manifest.parts[part]):
            loaded[part] = _load_part(d, manifest, part)
            num_bytes += manifest.part_bytes[part]
        if part in loaded:
            samples = [loaded[part].samples[pos] for pos in positions]
        else:
            samples, n = _load_part_samples(d, manifest, part, positions)
            num_bytes += n
        got |= {(part, pos): sample for pos, sample in zip(positions, samples)}
    return [got[where[i]] for i in wanted], num_bytes


def _load_part(d: Path, manifest: BatchManifest, part: int) -> RolloutBatch:
    path = d / _part_name(manifest, part)
    got = load_batch_file(path, expected_step=manifest.step)
    _check_lengths(path, got, [manifest.lengths[i] for i in manifest.parts[part]])
    return got


def _load_part_samples(
    d: Path, manifest: BatchManifest, part: int, positions: list[int]
) -> tuple[list[RolloutSample], int]:
    """The samples at `positions` of a part, reading only their tokens; and the bytes read."""
    path = d / _part_name(manifest, part)
    if not path.is_file():
        raise BatchFormatError(f"{path}: missing batch file")
    try:
        with safe_open(str(path), framework="numpy") as f:
            columns = {key: _rows(f.get_slice(key)) for key in f.keys()}  # noqa: SIM118 (not a mapping)
            arrays, meta = select_encoded(columns, dict(f.metadata() or {}), positions, where=str(path))
    except (SafetensorError, OSError) as e:
        raise BatchFormatError(f"{path}: not a readable safetensors file ({e})") from None
    got = decode_batch(arrays, meta, where=str(path))
    if got.step != manifest.step:
        raise BatchFormatError(f"{path}: metadata 'step' is {got.step}, expected {manifest.step}")
    _check_lengths(path, got, [manifest.lengths[manifest.parts[part][pos]] for pos in positions])
    return got.samples, _header_bytes(path) + sum(a.nbytes for a in arrays.values())


def _rows(lazy: Any) -> Any:
    """Rows start:stop of a lazily read safetensors array (only those bytes leave the file)."""
    return lambda start, stop: lazy[start:stop]


def _header_bytes(path: Path) -> int:
    """Size of a safetensors file's header: its 8-byte length prefix and the JSON it announces."""
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def _part_name(manifest: BatchManifest, part: int) -> str:
    name = manifest.files[part]
    assert name is not None, f"part {part} is empty and has no file"
    return name


def _check_lengths(path: Path, got: RolloutBatch, want: list[int]) -> None:
    lengths = [s.num_tokens for s in got.samples]
    if lengths != want:
        raise BatchFormatError(f"{path}: holds samples of {lengths} tokens, the manifest lists {want}")


def load_batch_file(path: Path, expected_step: int | None = None) -> RolloutBatch:
    """Decode one batch (or part) file, with errors that name the file."""
    if not path.is_file():
        raise BatchFormatError(f"{path}: missing batch file")
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
