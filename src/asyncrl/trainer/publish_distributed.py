"""Publishing over update channels (`[weights] transport = "distributed"`, docs/weights-transfer.md).

    publisher = DistributedWeightPublisher(run_dir, model_dir, cfg.publish, cfg.weights, info, model, 0)
    publisher.publish(model, step)                 # every rank: snapshot, then a thread sends it
    publisher.publish(model, step, to_disk=True)   # a checkpoint's or the last step: files as well
    publisher.wait()                               # the last version went out (collective)

Trainer rank 0 hosts the run's control store at `[weights] endpoint`; every rank sends its own
shards of each version, in the serving format, to every server's channel from a background thread
(`asyncrl.weight_transfer.SendLoop`), while the next step computes. The main thread only takes
the snapshot (collective for FP8: the block scales are all-reduced over the trainer's group, never
from the thread). A server that joins or restarts gets the current version whole at once, steps
or no steps; before the first step that is the version the trainer started from (0, or the step it
resumed at).

Once every channel answered, rank 0 makes the version visible to the orchestrator as a small
publication, `RUN/weights/step_n/` with config.json and `manifest.json` (transport, the servers that
took it, bytes, seconds, the fraction of serving values that changed), through the same
begin/commit protocol as files (STABLE, keep-last-K, retraction on `--resume`). A version that
must stay on disk (`to_disk`: every checkpoint step and the last) is also written as files by
`FilesystemWeightPublisher`, and that publication, tensors included, is the version's: a run
still ends with usable weights, and `--resume` from a checkpoint c finds v_c's files. At most one
version is in flight: `publish` waits for the previous one.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from asyncrl.config.trainer import PublishConfig
from asyncrl.config.weights import DistributedWeightsConfig
from asyncrl.distributed import DistInfo
from asyncrl.model import Transformer, torch_dtype
from asyncrl.model.dtypes import dtype_name
from asyncrl.model.hf import plan_files
from asyncrl.model.serving import ServingFormat, quantization_config_for, serving_format
from asyncrl.trainer.publish import FilesystemWeightPublisher
from asyncrl.transport import begin_publication, commit_publication, discard_publication
from asyncrl.transport.weights import TRANSFER_MANIFEST
from asyncrl.weight_transfer import (
    BucketSender,
    SendLoop,
    Shard,
    VersionReport,
    WeightsEndpoint,
    connect_store,
    host_store,
    iter_shards,
)

__all__ = ["DistributedWeightPublisher"]

log = logging.getLogger(__name__)

_CONNECT_S = 600.0  # the other ranks wait this long for rank 0's store


class DistributedWeightPublisher:
    """See the module docstring. Built on every rank, after the model and its checkpoint are loaded."""

    def __init__(
        self,
        run_dir: Path,
        tokenizer_dir: Path,
        cfg: PublishConfig,
        weights: DistributedWeightsConfig,
        info: DistInfo,
        model: Transformer,
        start_step: int,
    ) -> None:
        assert weights.endpoint is not None, "the config requires an endpoint with transport = distributed"
        self.run_dir, self.cfg, self.info = Path(run_dir), cfg, info
        self._delta = weights.delta
        self.fmt = serving_format(model, torch_dtype(cfg.dtype), fp8=cfg.fp8, ignore=cfg.fp8_ignore)
        self._config = _hf_config(model, self.fmt, cfg) if info.is_main else {}
        self._files = FilesystemWeightPublisher(self.run_dir, tokenizer_dir, cfg, info)
        self._on_disk: set[int] = set()  # versions whose publication is files
        self._pending: int | None = None
        # the last two snapshots: once version v is out, v - 1's is read by nothing (the send thread
        # holds v's), and v + 1's snapshot is taken into its memory
        self._recent: list[list[Shard]] = [list(iter_shards(model, self.fmt))]
        endpoint = WeightsEndpoint.parse(weights.endpoint, "trainer")
        if info.is_main:
            store = host_store(endpoint.port, num_senders=info.world_size)
        else:
            store = connect_store(endpoint.host, endpoint.port, timeout_s=_CONNECT_S)
        self._loop = SendLoop(
            store,
            rank=info.rank,
            world_size=info.world_size,
            sender=BucketSender(bucket_bytes=weights.bucket_bytes, delta=weights.delta),
            timeout_s=weights.timeout_s,
            initial=(start_step, self._recent[-1]),
            on_version=self._commit if info.is_main else None,
            device=info.device,
        )
        self._loop.start()

    def publish(self, model: Transformer, step: int, *, to_disk: bool = False) -> None:
        self.wait()
        spare = self._recent[0] if len(self._recent) == 2 else []
        # collective with FP8: on the main thread; with deltas, compared with the version before as
        # it is copied (what the sender would otherwise do in a pass of its own)
        against = self._recent[-1] if self._delta else []
        shards = list(iter_shards(model, self.fmt, into=spare, against=against))
        self._recent = [self._recent[-1], shards]
        if to_disk:
            self._on_disk.add(step)
            self._files.publish(model, step)
        self._loop.submit(step, shards)
        self._pending = step

    def wait(self) -> None:
        self._files.wait()
        pending, self._pending = self._pending, None
        if pending is not None:
            self._loop.wait(pending)

    def close(self) -> None:
        self._files.close()
        self._loop.close()

    def _commit(self, report: VersionReport) -> None:
        """Rank 0, on the sending thread: log the version, and publish it unless its files do."""
        print(f"asyncrl trainer: {_describe(report)}", flush=True)
        if report.version in self._on_disk:
            self._on_disk.discard(report.version)
            return
        content = None
        try:
            content = begin_publication(self.run_dir, report.version)
            (content / "config.json").write_text(json.dumps(self._config, indent=2) + "\n")
            (content / TRANSFER_MANIFEST).write_text(json.dumps(_manifest(report), indent=2) + "\n")
            commit_publication(self.run_dir, report.version, content, keep_last=self.cfg.keep_last)
        except OSError as e:  # DiskFullError too: the servers hold the version; the next one may fit
            if content is not None:
                discard_publication(content)
            print(f"asyncrl trainer: publishing v{report.version} failed: {e}", flush=True)


def _hf_config(model: Transformer, fmt: ServingFormat, cfg: PublishConfig) -> dict[str, Any]:
    """config.json as the files of the same version would carry it (dtype, FP8 quantization)."""
    config = model.args.to_hf_config(dtype_name(fmt.dtype))
    config.pop("quantization_config", None)
    plan = plan_files(model, cfg.max_shard_bytes, fmt)
    if quantization := quantization_config_for(plan.split.tensor_to_filename, fmt):
        config["quantization_config"] = quantization
    return config


def _manifest(report: VersionReport) -> dict[str, Any]:
    return {
        "transport": "distributed",
        "version": report.version,
        "servers": list(report.servers),
        "left_behind": list(report.left_behind),
        "errors": report.errors,
        "num_bytes": report.num_bytes,
        "seconds": report.seconds,
        "changed_fraction": report.changed_fraction,
    }


def _describe(report: VersionReport) -> str:
    changed = "" if report.changed_fraction is None else f", {report.changed_fraction:.2%} of values changed"
    line = (
        f"weights v{report.version} sent: {report.num_bytes / 1e6:.1f} MB to {len(report.servers)} server(s) "
        f"in {report.seconds:.3f} s{changed}"
    )
    if report.left_behind:
        line += f"; LEFT BEHIND: {', '.join(report.left_behind)} (they keep their weights until they rejoin)"
    return line
