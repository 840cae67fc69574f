"""Weight publishing: after step n, make policy version v_n available to the inference servers.

`WeightPublisher` is the interface; `FilesystemWeightPublisher` writes `RUN/weights/step_n/` in
Hugging Face layout (safetensors + config.json + the tokenizer files of the source model) through
the publication protocol of `asyncrl.transport` (a directory of its own, STABLE marker, `step_n`
link swapped in one rename, keep last K), every version (`to_disk` is always true for it).
`asyncrl.trainer.publish_distributed` sends versions over process groups instead.

The files hold what the servers serve (`[publish] dtype`, `fp8`): bf16 halves an fp32 master's
bytes, FP8 quarters them. They are planned from shapes alone (`asyncrl.model.hf.plan_files`, the
same files at every world size), and shared out among the ranks, largest first to the least loaded
(`assign_files`). Every rank gathers only the full tensors of its own files, one at a time
(`asyncrl.distributed.iter_full_tensors`), converts them and writes its files; rank 0 then writes
config.json, the index and the tokenizer files, and makes the version visible.

With `[publish] overlap` (the default) a step only takes the snapshot: its files' tensors in the
serving dtype, in host memory (this rank's share of the model in that dtype, e.g. 2 bytes per
parameter / world size for bf16). A background thread writes them while the next step computes;
STABLE comes only once every rank's files are written. At most one publish is in flight: the next
publish, a checkpoint and the last step wait for it (`wait`). A failed write stops the trainer at
that wait on every rank: `DiskFullError` for a full disk, else `PublishError` naming the path.

Before writing, rank 0 checks the free space against the files' bytes in the serving format; a
publish that does not fit (then, or a full disk while writing) raises `DiskFullError` on every rank
and publishes nothing.
"""

from __future__ import annotations

import shutil
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from safetensors import SafetensorError

from asyncrl.config.trainer import PublishConfig
from asyncrl.distributed import DistInfo, all_reduce_, iter_full_tensors
from asyncrl.model import HFCheckpointWriter, Transformer, torch_dtype
from asyncrl.model import hf as hf_format
from asyncrl.model.hf import FilePlan, plan_files, to_hf_tensors
from asyncrl.model.serving import SCALE_SUFFIX, is_fp8_scale, serving_format, to_serving
from asyncrl.run_dir import weights_dir
from asyncrl.trainer.diskspace import ensure_free_space, raise_together
from asyncrl.transport import (
    STABLE_MARKER,
    DiskFullError,
    begin_publication,
    commit_publication,
    discard_publication,
    disk_full_as_error,
)

__all__ = [
    "FilesystemWeightPublisher",
    "PublishError",
    "WeightPublisher",
    "assign_files",
    "copy_tokenizer_files",
]

_WEIGHT_FILES = ("config.json", "model.safetensors.index.json", STABLE_MARKER)
_OK, _DISK_FULL, _FAILED = 0, 1, 2  # a rank's outcome, all-reduced with max


class PublishError(RuntimeError):
    """Writing published weights failed for a reason other than a full disk."""


class WeightPublisher(Protocol):
    def publish(self, model: Transformer, step: int, *, to_disk: bool = False) -> None:
        """Start making the current weights available as policy version `step`. Called on every rank.
        `to_disk`: the version must also be on disk as files (a checkpoint's step, the last step)."""
        ...

    def wait(self) -> None:
        """Return once the last publish is complete; raise its failure on every rank. Collective."""
        ...

    def close(self) -> None:
        """Let a write in flight end (no collective: also on the way out of an error)."""
        ...


def _tokenizer_files(src: Path) -> list[Path]:
    """Every top-level file of `src` that is not weights or config (tokenizer, chat template...)."""
    return [
        f
        for f in sorted(src.iterdir())
        if f.is_file() and f.suffix != ".safetensors" and f.name not in _WEIGHT_FILES
    ]


def copy_tokenizer_files(src: Path, dst: Path) -> list[str]:
    """Copy `src`'s tokenizer files into `dst`; returns their names."""
    copied = []
    for f in _tokenizer_files(src):
        shutil.copy2(f, dst / f.name)
        copied.append(f.name)
    return copied


def _tokenizer_bytes(src: Path) -> int:
    return sum(f.stat().st_size for f in _tokenizer_files(src))


def assign_files(file_bytes: dict[str, int], world_size: int) -> dict[str, int]:
    """file -> the rank that writes it: largest file first, to the rank with the fewest bytes so far."""
    load = [0] * world_size
    owner = {}
    for file in sorted(file_bytes, key=lambda f: (-file_bytes[f], f)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[file] = rank
        load[rank] += file_bytes[file]
    return owner


@dataclass(frozen=True, kw_only=True)
class _Layout:
    """Who writes what, planned once from shapes (the same on every rank)."""

    plan: FilePlan
    files: tuple[str, ...]  # this rank's
    wanted: frozenset[str]  # the file tensors of this rank's files
    owners: dict[str, tuple[int, ...]]  # our name -> ranks that write one of its file tensors
    fp8_entries: frozenset[str]  # our names stored as FP8 blocks

    @classmethod
    def build(cls, plan: FilePlan, info: DistInfo) -> _Layout:
        owner = assign_files(plan.file_bytes, info.world_size)
        file_of = plan.split.tensor_to_filename
        files = tuple(f for f, r in owner.items() if r == info.rank)
        wanted = frozenset(t for f in files for t in plan.split.filename_to_tensors[f])
        owners = {
            name: tuple(sorted({owner[file_of[t]] for t in outs})) for name, outs in plan.sources.items()
        }
        fp8 = frozenset(name for name, outs in plan.sources.items() if any(map(is_fp8_scale, outs)))
        return cls(plan=plan, files=files, wanted=wanted, owners=owners, fp8_entries=fp8)


@dataclass(kw_only=True)
class _Job:
    """One version being written by this rank: its shards, and what went wrong."""

    step: int
    final: Path  # weights/step_n, what a full disk names
    content: Path  # weights/.step_n.<id>/, shared by all ranks
    queue: list[tuple[Path, dict[str, torch.Tensor]]] = field(default_factory=list)
    error: Exception | None = None

    @property
    def what(self) -> str:
        return f"published weights of step {self.step}"

    def save(self, path: Path, tensors: dict[str, torch.Tensor]) -> None:
        """Write one shard now; after a failure, skip (the gathers go on: the other ranks need them)."""
        if self.error is not None:
            return
        try:
            with disk_full_as_error(self.final, self.what):
                # hf's save_file, looked up now: the tests stand in a failing disk there
                hf_format.save_file(tensors, str(path), metadata={"format": "pt"})
        except (OSError, SafetensorError) as e:
            self.fail(e, path)

    def fail(self, e: Exception, path: Path) -> None:
        if isinstance(e, DiskFullError):
            self.error = e
        else:
            self.error = PublishError(f"writing the {self.what} to {path} failed: {type(e).__name__}: {e}")
            self.error.__cause__ = e

    @property
    def outcome(self) -> int:
        return _OK if self.error is None else _DISK_FULL if isinstance(self.error, DiskFullError) else _FAILED


class FilesystemWeightPublisher:
    """Every rank writes its share of weights/step_n/ in the serving format; rank 0 makes it visible."""

    def __init__(self, run_dir: Path, tokenizer_dir: Path, cfg: PublishConfig, info: DistInfo) -> None:
        self.run_dir, self.tokenizer_dir, self.cfg, self.info = run_dir, tokenizer_dir, cfg, info
        # The background thread's own group: its one all-reduce never interleaves with the step's.
        self._group = dist.new_group(backend="gloo") if info.is_distributed and cfg.overlap else None
        self._layout: _Layout | None = None
        self._job: _Job | None = None  # the publish in flight or not yet reported
        self._thread: threading.Thread | None = None

    def publish(self, model: Transformer, step: int, *, to_disk: bool = False) -> None:
        self.wait()
        layout = self._layout_of(model)
        need = layout.plan.total_bytes + _tokenizer_bytes(self.tokenizer_dir) if self.info.is_main else 0
        ensure_free_space(
            weights_dir(self.run_dir, step), need, f"published weights of step {step}", self.info
        )
        job = _Job(step=step, final=weights_dir(self.run_dir, step), content=self._begin(step))
        save_shard = (
            (lambda path, tensors: job.queue.append((path, tensors))) if self.cfg.overlap else job.save
        )
        writer = HFCheckpointWriter(
            job.content, model, plan=layout.plan, files=layout.files, save_shard=save_shard
        )
        try:
            self._snapshot(model, layout, writer)
        except BaseException:
            if self.info.is_main:
                discard_publication(job.content)
            raise
        self._job = job
        if self.cfg.overlap:
            self._thread = threading.Thread(
                target=self._write_in_background, args=(job, writer), name=f"publish-step-{step}", daemon=True
            )
            self._thread.start()
        else:
            writer.finish(metadata=False)  # every tensor of this rank's files came
            self._finish(job, writer, group=None)
            self.wait()

    def wait(self) -> None:
        job, self._job = self._job, None
        if job is None:
            return
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        _raise_together(job, self.info)

    def close(self) -> None:
        job, thread = self._job, self._thread
        if thread is not None:
            thread.join()
        if job is not None and job.error is not None:
            print(f"asyncrl trainer: {job.error}", file=sys.stderr, flush=True)

    # -- the steps of one publish ---------------------------------------------------------------
    def _layout_of(self, model: Transformer) -> _Layout:
        if self._layout is None:  # the model's shapes and modules do not change during a run
            cfg = self.cfg
            fmt = serving_format(model, torch_dtype(cfg.dtype), fp8=cfg.fp8, ignore=cfg.fp8_ignore)
            self._layout = _Layout.build(plan_files(model, cfg.max_shard_bytes, fmt), self.info)
        return self._layout

    def _begin(self, step: int) -> Path:
        """Rank 0 makes the publication's directory; every rank gets its path."""
        content, error = None, None
        if self.info.is_main:
            try:
                content = begin_publication(self.run_dir, step)
            except DiskFullError as e:
                error = e
        raise_together(error, self.info)
        if self.info.is_distributed:
            box = [content]
            dist.broadcast_object_list(box, src=0)
            content = box[0]
        assert content is not None
        return Path(content)

    def _snapshot(self, model: Transformer, layout: _Layout, writer: HFCheckpointWriter) -> None:
        """Gather this rank's tensors and hand them to its writer in the serving format. Collective.

        A tensor that is only cast is gathered in the serving dtype (half the bytes of an fp32
        gather for bf16); one that is quantized is gathered as it is, so its FP8 blocks are those
        of one process. A snapshot that a background thread writes must not share storage with
        the parameters, which the next optimizer step changes in place.
        """
        fmt, wanted = layout.plan.fmt, layout.wanted
        tensors = iter_full_tensors(
            model,
            lambda name: layout.owners[name],
            lambda name: None if name in layout.fp8_entries else fmt.dtype,
            copy=self.cfg.overlap,
        )
        with torch.no_grad():
            for name, full in tensors:
                for hf_name, t in to_hf_tensors(name, full):
                    if hf_name not in wanted and hf_name + SCALE_SUFFIX not in wanted:
                        continue  # another rank's (a weight and its scales may sit in two files)
                    for out_name, out in to_serving(hf_name, t, fmt):
                        if out_name in wanted:
                            writer.add(out_name, out)

    def _write_in_background(self, job: _Job, writer: HFCheckpointWriter) -> None:
        """The thread's body. Every failure is kept for the next `wait()`, which raises it; the
        all-reduce in `_finish` runs whatever happened before it, or the other ranks would hang."""
        try:
            for path, tensors in job.queue:
                job.save(path, tensors)
            writer.finish(metadata=False)
        except Exception as e:  # the thread's top level
            if job.error is None:
                job.fail(e, job.content)
        job.queue.clear()
        try:
            self._finish(job, writer, group=self._group)
        except Exception as e:  # the thread's top level
            if job.error is None:
                job.fail(e, job.content)

    def _finish(self, job: _Job, writer: HFCheckpointWriter, group: dist.ProcessGroup | None) -> None:
        """Once every rank has written its files: rank 0 adds config, index and tokenizer, then
        commits (STABLE, the step_n link, pruning); a failure anywhere discards the publication."""
        flag = torch.tensor([job.outcome], device="cpu" if group is not None else self.info.device)
        if self.info.is_distributed:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if not self.info.is_main:
            return
        if int(flag[0]) == _OK:
            try:
                with disk_full_as_error(job.final, job.what):
                    writer.write_metadata()
                    copy_tokenizer_files(self.tokenizer_dir, job.content)
                    commit_publication(self.run_dir, job.step, job.content, keep_last=self.cfg.keep_last)
                return
            except (OSError, SafetensorError) as e:
                job.fail(e, job.content)
        discard_publication(job.content)


def _raise_together(job: _Job, info: DistInfo) -> None:
    """Raise `job`'s failure on every rank (this rank's own error where it has one). Collective."""
    flag = torch.tensor([float(job.outcome)], device=info.device)
    all_reduce_(flag, info, "max")
    outcome = int(flag.item())
    if job.error is not None:
        raise job.error
    if outcome == _DISK_FULL:
        raise DiskFullError(
            f"another rank could not write the {job.what} to a full disk (rank 0 names the path)"
        )
    if outcome == _FAILED:
        raise PublishError(
            f"another rank failed to write the {job.what} to {job.content} (its error names the cause)"
        )
