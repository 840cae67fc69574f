"""Trainer and SFT configuration (torch-free schemas; see base.py for the TOML / CLI grammar).

    asyncrl trainer @ rl.toml --run-dir outputs/demo --loss.variant tis --optim.lr 1e-5
    asyncrl sft @ sft.toml --data.path data/sft.jsonl --max-steps 200

Both commands share the model, optimizer, schedule, checkpoint and publish sections, so an SFT
run and an RL run write the same run-directory layout (ARCHITECTURE.md, "Run directory").
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from asyncrl.config.base import BaseConfig
from asyncrl.config.mismatch import FP8Config, MismatchConfig
from asyncrl.config.parallel import ParallelConfig

__all__ = [
    "CheckpointConfig",
    "CommonTrainConfig",
    "LossConfig",
    "ModelLoadConfig",
    "OptimConfig",
    "PublishConfig",
    "RLTrainerConfig",
    "SFTConfig",
    "SFTDataConfig",
    "SFTStopConfig",
    "ScheduleConfig",
]


class ModelLoadConfig(BaseConfig):
    """Which Hugging Face directory to train, and in what precision."""

    path: Path  # HF directory: config.json + safetensors + tokenizer files
    dtype: Literal["float32", "bfloat16"] = "float32"
    device: str = "cpu"  # "cpu", "cuda" (each rank uses cuda:LOCAL_RANK)


class LossConfig(BaseConfig):
    """Token-level policy-gradient loss with off-policy correction; formulas in docs/trainer.md.

    variant:
      trust_region  mask tokens whose pi - mu leaves [-delta_low, delta_high] in the advantage's
                    direction, plus kl_coef * (log r)^2 (default)
      tis           truncated importance sampling: weight min(r, tis_cap), detached
      mis           mask tokens with r outside [mis_low, mis_high] (IcePop style)
      sequence      mask whole sequences whose geometric-mean ratio lies outside [seq_low, seq_high]
    """

    variant: Literal["trust_region", "tis", "mis", "sequence"] = "trust_region"
    delta_low: float = Field(0.2, gt=0)  # allowed drop of pi below mu where the advantage is negative
    delta_high: float = Field(0.2, gt=0)  # allowed rise of pi above mu where the advantage is positive
    kl_coef: float = Field(1e-3, ge=0)  # weight of the (log r)^2 penalty (every variant)
    tis_cap: float = Field(2.0, gt=0)
    mis_low: float = Field(0.5, gt=0)
    mis_high: float = Field(2.0, gt=0)
    seq_low: float = Field(0.5, gt=0)
    seq_high: float = Field(2.0, gt=0)

    @model_validator(mode="after")
    def _check_bounds(self) -> LossConfig:
        for low, high in (("mis_low", "mis_high"), ("seq_low", "seq_high")):
            if getattr(self, low) >= getattr(self, high):
                raise ValueError(
                    f"loss.{low} ({getattr(self, low)}) must be below loss.{high} ({getattr(self, high)})"
                )
        return self


class OptimConfig(BaseConfig):
    lr: float = Field(1e-5, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)


class ScheduleConfig(BaseConfig):
    """Linear warmup, then constant or cosine decay to min_lr_ratio * lr at max_steps."""

    kind: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)


class CheckpointConfig(BaseConfig):
    """Full training state (model, optimizer, scheduler, RNG, step) via torch.distributed.checkpoint."""

    interval: int = Field(0, ge=0)  # save every N steps; 0 = never (the final step is still saved if > 0)
    keep_last: int = Field(2, ge=1)


class PublishConfig(BaseConfig):
    """Where each policy version goes after its optimizer step."""

    kind: Literal["filesystem"] = "filesystem"  # a torch.distributed broadcast can be added later
    keep_last: int = Field(3, ge=1)  # weights/step_n directories kept on disk
    interval: int = Field(1, ge=1)  # publish every N steps


class CommonTrainConfig(BaseConfig):
    """Sections shared by the RL trainer and SFT: model, run directory, optimizer, checkpoints, publishing."""

    model: ModelLoadConfig
    run_dir: Path = Path("outputs/run")
    max_steps: int = Field(..., ge=1)
    seq_len: int = Field(2048, gt=0)  # max tokens in one packed micro-batch row
    seed: int = 0
    resume: bool = False  # `--resume`: continue from the latest checkpoint under run_dir/checkpoints
    resume_step: int | None = Field(None, ge=1)  # `--resume-step N`: continue from step N's checkpoint
    optim: OptimConfig = OptimConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    publish: PublishConfig = PublishConfig()
    peak_flops: float | None = Field(None, gt=0)  # per device, for MFU; None = measure a matmul at start
    logits_chunk_size: int = Field(1024, gt=0)  # tokens per LM-head chunk (bounds [chunk, vocab] memory)
    fp8: FP8Config = FP8Config()  # block-scale FP8 training (match an FP8 inference server)
    parallel: ParallelConfig = ParallelConfig()  # FSDP2 / EP / CP degrees under torchrun (docs/scaling.md)


class RLTrainerConfig(CommonTrainConfig):
    """`asyncrl trainer`: consume rollouts/step_n, produce weights/step_n."""

    loss: LossConfig = LossConfig()
    router_replay: bool = True  # replay the inference engine's expert choices when a sample carries them
    batch_timeout_s: float = Field(600.0, gt=0)  # how long to wait for rollouts/step_n
    mismatch: MismatchConfig = MismatchConfig()  # per-step mismatch metrics and the max_mismatch_kl gate

    @model_validator(mode="after")
    def _check_cp_loss(self) -> RLTrainerConfig:
        if self.parallel.cp > 1 and self.loss.variant == "sequence":
            raise ValueError(
                f"loss.variant = 'sequence' needs whole sequences on one rank, but parallel.cp = "
                f"{self.parallel.cp} splits them; use another variant or parallel.cp = 1"
            )
        return self


class SFTDataConfig(BaseConfig):
    """JSONL rows: {"messages": [...]} (loss on assistant turns) or {"prompt": .., "completion": ..}."""

    path: Path
    batch_size: int = Field(8, ge=1)  # sequences per optimizer step (over all ranks)
    shuffle: bool = True


class SFTStopConfig(BaseConfig):
    """Stop before max_steps once the mean loss of the last `window` steps is at most `loss`.

    A step's loss is measured before the update on rows the model has not trained on yet, as long as
    max_steps * batch_size stays within one pass over the data: it is then a held-out loss, and a
    threshold that only a learned skill reaches ends the run when the skill is there, wherever the
    run's numerics put that point. max_steps stays the cap. The last step is published and
    checkpointed as the final one.
    """

    loss: float | None = Field(None, gt=0)  # None: always run max_steps
    window: int = Field(25, ge=1)  # steps averaged; one batch alone is noisy


class SFTConfig(CommonTrainConfig):
    """`asyncrl sft`: cross-entropy on chat / prompt-completion data, same outputs as the RL trainer."""

    data: SFTDataConfig
    stop: SFTStopConfig = SFTStopConfig()
