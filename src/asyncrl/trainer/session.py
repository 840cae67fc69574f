"""What an RL and an SFT run share: set-up, resume, and the end of every step.

session = TrainSession.build(cfg)                 # dist, model, optimizer, schedule, resume
for step in range(session.start_step + 1, cfg.max_steps + 1):
    result = session.step_runner.step(micro_batches, loss_fn, step)
    session.end_step(step, result, extra_metrics)  # publish, checkpoint, metrics
session.close()
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.config.trainer import CommonTrainConfig
from asyncrl.distributed import DistInfo, init_distributed
from asyncrl.model import Transformer, cpu_norm, cpu_scores, from_pretrained, torch_dtype
from asyncrl.model.compute import cpu_kernels
from asyncrl.model.fp8 import apply_fp8
from asyncrl.run_dir import checkpoints_root
from asyncrl.trainer.checkpoint import (
    CheckpointNotFoundError,
    checkpoint_metrics,
    latest_checkpoint_step,
    load_checkpoint,
    save_checkpoint,
)
from asyncrl.trainer.metrics import MetricsLogger, flops_per_token, measure_matmul_peak, peak_memory_bytes
from asyncrl.trainer.optim import build_optimizer, build_scheduler
from asyncrl.trainer.publish import FilesystemWeightPublisher, WeightPublisher
from asyncrl.trainer.publish_distributed import DistributedWeightPublisher
from asyncrl.trainer.scaleout import ParallelState, build_parallel_model, resolve_dims
from asyncrl.trainer.step import StepResult, StepRunner
from asyncrl.transport.sinks import build_sinks

__all__ = ["TrainSession", "resolve_resume_step"]


def resolve_resume_step(cfg: CommonTrainConfig) -> int | None:
    """The checkpoint step to resume from, or None for a fresh run."""
    if cfg.resume_step is not None:
        return cfg.resume_step
    if not cfg.resume:
        return None
    step = latest_checkpoint_step(cfg.run_dir)
    if step is None:
        raise CheckpointNotFoundError(
            f"--resume is set but {checkpoints_root(cfg.run_dir)} holds no complete checkpoint"
        )
    return step


@dataclass(kw_only=True)
class TrainSession:
    cfg: CommonTrainConfig
    info: DistInfo
    model: Transformer
    step_runner: StepRunner
    publisher: WeightPublisher
    logger: MetricsLogger
    peak_flops: float  # per device
    start_step: int  # the last completed step (0 for a fresh run)
    parallel: ParallelState | None = None  # None at world size 1 (a plain model)

    @property
    def data_rank(self) -> int:
        """Which share of a batch this rank trains on (CP ranks of one group share theirs)."""
        return self.parallel.dp_rank if self.parallel is not None else self.info.rank

    @property
    def data_size(self) -> int:
        return self.parallel.dims.dp_size if self.parallel is not None else self.info.world_size

    @classmethod
    def build(cls, cfg: CommonTrainConfig, publisher: WeightPublisher | None = None) -> TrainSession:
        dims = resolve_dims(cfg.parallel, cfg.model.path)  # before any process group: fails early
        info = init_distributed(cfg.model.device)
        torch.manual_seed(cfg.seed)
        dtype = torch_dtype(cfg.model.dtype)
        parallel = None
        if info.is_distributed:
            if cfg.fp8.enabled:
                raise ValueError(
                    "fp8.enabled with world size > 1 is not supported yet: FP8 modules are not wired "
                    "into the FSDP2/EP build (train with FP8 on one process)"
                )
            model, parallel = build_parallel_model(cfg, dims, info)
        else:
            model = from_pretrained(cfg.model.path, dtype=dtype, device=str(info.device))
            if cfg.fp8.enabled:
                apply_fp8(model, cfg.fp8.ignore, cfg.fp8.backend)
        model.train()
        optimizer = build_optimizer(model, cfg.optim)
        scheduler = build_scheduler(optimizer, cfg.schedule, cfg.max_steps)
        start_step = 0
        resume = resolve_resume_step(cfg)
        if resume is not None:
            start_step = load_checkpoint(cfg.run_dir, resume, model, optimizer, scheduler)
        step_runner = StepRunner(
            model,
            optimizer,
            scheduler,
            info,
            max_grad_norm=cfg.optim.max_grad_norm,
            chunk_size=cfg.logits_chunk_size,
            ratio_bounds=_ratio_bounds(cfg),
            parallel=parallel,
        )
        peak = cfg.peak_flops or measure_matmul_peak(info.device, dtype)
        if info.is_main and info.device.type == "cpu":
            print(f"asyncrl trainer: {_cpu_kernels_line(dtype)}", flush=True)
        session = cls(
            cfg=cfg,
            info=info,
            model=model,
            step_runner=step_runner,
            publisher=publisher or _build_publisher(cfg, info, model, start_step),
            logger=MetricsLogger(
                cfg.run_dir,
                enabled=info.is_main,
                # `asyncrl sft` only: under `asyncrl rl` the launcher feeds the sinks from metrics.jsonl
                sinks=build_sinks(getattr(cfg, "sinks", None), cfg.run_dir) if info.is_main else None,
                total_steps=cfg.max_steps,
                start_step=start_step,
            ),
            peak_flops=peak,
            start_step=start_step,
            parallel=parallel,
        )
        if resume is not None:
            session.log_checkpointed_step()
        return session

    def log_checkpointed_step(self) -> None:
        """Log the resumed checkpoint's metrics line if a kill fell between the checkpoint and the line.

        A checkpoint saved without a metrics record has nothing to log.
        """
        record = checkpoint_metrics(self.cfg.run_dir, self.start_step) if self.logger.enabled else None
        if record is not None:
            self.logger.log_missing(record)

    def step_metrics(self, step: int, result: StepResult) -> dict[str, Any]:
        tokens_per_s = result.num_tokens / max(result.seconds, 1e-9)
        flops = flops_per_token(self.model.args, result.mean_context)
        record: dict[str, Any] = {"step": step} | asdict(result)
        record |= record.pop("mismatch")
        record["tokens_per_s"] = tokens_per_s
        record["mfu"] = flops * tokens_per_s / (self.peak_flops * self.info.world_size)
        record["peak_memory_gb"] = peak_memory_bytes(self.info.device) / 1e9
        return record

    def end_step(
        self,
        step: int,
        result: StepResult,
        extra: dict[str, Any] | None = None,
        drop_keys: tuple[str, ...] = (),
        last: bool = False,
    ) -> dict[str, Any]:
        """Publish v_step, checkpoint on the interval (and at the last step: max_steps, or `last`
        for a run that stops early), log the metrics.

        A publish may still be writing when this returns (`[publish] overlap`); a checkpoint waits
        for it first, so the weights of every checkpointed step are published, and so does the last
        step. Those steps' versions are files on disk whatever the transport (`to_disk`).
        `publish_s` is the time the step spent publishing (and waiting for a write). A checkpoint
        stores the step's complete record, logged on resume if metrics.jsonl lacks it (`build`).
        """
        cfg = self.cfg
        last = last or step == cfg.max_steps
        interval = cfg.checkpoint.interval
        checkpoint = bool(interval) and (step % interval == 0 or last)
        start = time.perf_counter()
        if step % cfg.publish.interval == 0 or last:
            self.publisher.publish(self.model, step, to_disk=checkpoint or last)
        if checkpoint or last:
            self.publisher.wait()
        publish_s = time.perf_counter() - start
        record = self.step_metrics(step, result) | {"publish_s": publish_s} | (extra or {})
        for key in drop_keys:
            record.pop(key, None)
        if checkpoint:
            save_checkpoint(
                cfg.run_dir,
                step,
                self.model,
                self.step_runner.optimizer,
                self.step_runner.scheduler,
                self.info,
                cfg.checkpoint.keep_last,
                metrics=record,  # a kill before the log below: the resumed session logs it from there
            )
        self.logger.log(record)
        return record

    def close(self) -> None:
        self.publisher.close()
        self.logger.close()
        if self.info.is_distributed and dist.is_initialized():
            dist.destroy_process_group()


def _build_publisher(
    cfg: CommonTrainConfig, info: DistInfo, model: Transformer, start_step: int
) -> WeightPublisher:
    """Files by default; update channels with `[weights] transport = "distributed"` (RL only)."""
    weights = getattr(cfg, "weights", None)
    if weights is not None and weights.transport == "distributed":
        return DistributedWeightPublisher(
            cfg.run_dir, cfg.model.path, cfg.publish, weights, info, model, start_step
        )
    return FilesystemWeightPublisher(cfg.run_dir, cfg.model.path, cfg.publish, info)


def _ratio_bounds(cfg: CommonTrainConfig) -> tuple[float, float]:
    mismatch = getattr(cfg, "mismatch", None)  # RL only; SFT has no inference logprobs
    return (mismatch.ratio_low, mismatch.ratio_high) if mismatch is not None else (0.5, 2.0)


def _cpu_kernels_line(dtype: torch.dtype) -> str:
    """The trainer's start-up line on a CPU: the ISA and which C kernels its steps take."""
    kernels = cpu_kernels()
    notes = [f"CPU {kernels.isa}", cpu_norm.note()]
    if dtype == torch.bfloat16 and kernels.native_bf16 and not kernels.amx:
        notes.append(f"blocked causal attention, {cpu_scores.note()}")
    return "; ".join(notes)
