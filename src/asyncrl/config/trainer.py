"""Trainer and SFT configuration (torch-free schemas; see base.py for the TOML / CLI grammar).

    asyncrl trainer @ rl.toml --run-dir outputs/demo --loss.variant tis --optim.lr 1e-5
    asyncrl sft @ sft.toml --data.path data/sft.jsonl --max-steps 200

Both commands share the model, optimizer, schedule, checkpoint and publish sections, so an SFT
run and an RL run write the same run-directory layout (docs/architecture.md, "Run directory").
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from asyncrl.config.base import BaseConfig
from asyncrl.config.fp8 import FP8Config
from asyncrl.config.mismatch import MismatchConfig
from asyncrl.config.parallel import ParallelConfig
from asyncrl.config.shared import DEFAULT_RUN_DIR, DEFAULT_SEQ_LEN, Device, SeqLen
from asyncrl.config.sinks import SinksConfig
from asyncrl.config.weights import FilesystemWeightsConfig, WeightsConfig
from asyncrl.fp8_options import DEFAULT_FP8_IGNORE

DEFAULT_MAX_SHARD_BYTES = 4 * 1024**3

__all__ = [
    "CheckpointConfig",
    "CommonTrainConfig",
    "LossConfig",
    "MISLossConfig",
    "ModelLoadConfig",
    "OptimConfig",
    "PublishConfig",
    "RLTrainerConfig",
    "SFTConfig",
    "SFTDataConfig",
    "SFTPublishConfig",
    "SFTStopConfig",
    "ScheduleConfig",
    "SequenceLossConfig",
    "TISLossConfig",
    "TrustRegionLossConfig",
]


class ModelLoadConfig(BaseConfig):
    """Which Hugging Face directory to train, and in what precision."""

    path: Path = Field(description="HF directory: config.json + safetensors + tokenizer files")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="parameter and compute dtype")
    device: Device = Field(
        "auto", description="auto = cuda when available, else cpu (each rank uses cuda:LOCAL_RANK)"
    )


class _LossBase(BaseConfig):
    kl_coef: float = Field(1e-3, ge=0, description="weight of the (log r)^2 penalty on every loss token")


class _RatioCapped(_LossBase):
    """ratio_cap bounds the importance weight r of every token in the -r * A variants (trust_region,
    mis, sequence). Inside the trust region's probability band a token the engine sampled at
    mu = 1e-4 that the trainer gives pi = 0.15 would otherwise weigh r = 1500."""

    ratio_cap: float = Field(
        2.0, ge=1, description="cap C on the token importance weight r = pi/mu; inf: uncapped"
    )
    ratio_cap_mode: Literal["truncate", "mask"] = Field(
        "truncate",
        description="tokens with r > ratio_cap: 'truncate' weighs them C (gradient -C * A * grad log pi, "
        "as TIS); 'mask' drops their policy-gradient term (as IcePop)",
    )


def _check_below(cfg: BaseConfig, low: str, high: str) -> None:
    if getattr(cfg, low) >= getattr(cfg, high):
        raise ValueError(f"{low} ({getattr(cfg, low)}) must be below {high} ({getattr(cfg, high)})")


class TrustRegionLossConfig(_RatioCapped):
    """Mask tokens whose pi - mu leaves [-delta_low, delta_high] in the advantage's direction (default)."""

    variant: Literal["trust_region"] = Field("trust_region", description="this loss variant")
    delta_low: float = Field(
        0.2, gt=0, description="allowed drop of pi below mu where the advantage is negative"
    )
    delta_high: float = Field(
        0.2, gt=0, description="allowed rise of pi above mu where the advantage is positive"
    )


class TISLossConfig(_LossBase):
    """Truncated importance sampling: weight min(r, tis_cap), detached."""

    variant: Literal["tis"] = Field("tis", description="this loss variant")
    tis_cap: float = Field(2.0, gt=0, description="importance weights are capped at this")


class MISLossConfig(_RatioCapped):
    """Mask tokens with r outside [mis_low, mis_high] (IcePop style)."""

    variant: Literal["mis"] = Field("mis", description="this loss variant")
    mis_low: float = Field(0.5, gt=0, description="tokens with r below this are masked")
    mis_high: float = Field(2.0, gt=0, description="tokens with r above this are masked")

    @model_validator(mode="after")
    def _check_bounds(self) -> MISLossConfig:
        _check_below(self, "mis_low", "mis_high")
        return self


class SequenceLossConfig(_RatioCapped):
    """Mask whole sequences whose geometric-mean ratio lies outside [seq_low, seq_high]."""

    variant: Literal["sequence"] = Field("sequence", description="this loss variant")
    seq_low: float = Field(0.5, gt=0, description="lower bound of the geometric-mean ratio")
    seq_high: float = Field(2.0, gt=0, description="upper bound of the geometric-mean ratio")

    @model_validator(mode="after")
    def _check_bounds(self) -> SequenceLossConfig:
        _check_below(self, "seq_low", "seq_high")
        return self


def _default_variant(table: Any) -> Any:
    """A [loss] table without `variant` is the default variant's."""
    if isinstance(table, dict) and "variant" not in table:
        return {"variant": "trust_region", **table}
    return table


# Token-level policy-gradient loss with off-policy correction; formulas in docs/trainer.md. Each
# variant takes only its own keys: a key of another variant is an error, not silently unused.
LossConfig = Annotated[
    TrustRegionLossConfig | TISLossConfig | MISLossConfig | SequenceLossConfig,
    Field(discriminator="variant"),
    BeforeValidator(_default_variant),
]


class OptimConfig(BaseConfig):
    """AdamW."""

    lr: float = Field(1e-5, gt=0, description="peak learning rate")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW (beta1, beta2)")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    weight_decay: float = Field(0.0, ge=0, description="decoupled weight decay")
    max_grad_norm: float = Field(1.0, gt=0, description="clip the global gradient norm to this")


class ScheduleConfig(BaseConfig):
    """Linear warmup, then constant or cosine decay to min_lr_ratio * lr at max_steps."""

    kind: Literal["constant", "cosine"] = Field("constant", description="shape after warmup")
    warmup_steps: int = Field(0, ge=0, description="steps of linear warmup from 0 to lr")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="cosine: final lr as a fraction of lr")


class CheckpointConfig(BaseConfig):
    """Full training state (model, optimizer, scheduler, RNG, step) via torch.distributed.checkpoint."""

    interval: int = Field(0, ge=0, description="save every N steps (and at the last step); 0 = never")
    keep_last: int = Field(2, ge=1, description="checkpoints/step_n directories kept on disk")


class PublishConfig(BaseConfig):
    """How each policy version is published to RUN/weights/step_n (HF safetensors), in the servers' format.

    Under `asyncrl rl`, `dtype`, `fp8` and `fp8_ignore` come from `[inference]` (its `dtype`,
    `fp8.enabled` and `fp8.ignore`), so the files are what the servers serve.
    """

    keep_last: int = Field(3, ge=1, description="weights/step_n directories kept on disk")
    interval: int = Field(1, ge=1, description="publish every N steps (and at the last step)")
    dtype: Literal["bfloat16", "float32"] = Field(
        "bfloat16",
        description="dtype of the published tensors: the servers' serving dtype (float32 for exact "
        "on-policy)",
    )
    fp8: bool = Field(
        False,
        description="servers run FP8: eligible linears as float8_e4m3fn + weight_scale_inv per 128x128 block "
        "(DeepSeek-V3 / vLLM layout), the rest in dtype",
    )
    fp8_ignore: list[str] = Field(
        default_factory=lambda: list(DEFAULT_FP8_IGNORE),
        description="with fp8: module names or fnmatch patterns kept in dtype (the servers' [fp8] ignore)",
    )
    overlap: bool = Field(
        True,
        description="write the files in a background thread while the next step computes (STABLE once "
        "written; at most one publish in flight); false: the step waits for the write",
    )
    max_shard_bytes: int = Field(
        DEFAULT_MAX_SHARD_BYTES,
        ge=1,
        description="size bound of one safetensors file; the files are shared out among the trainer ranks",
    )


class SFTPublishConfig(PublishConfig):
    """An SFT run's weights/step_n is the model it produced (the start of an RL run): fp32 by default."""

    dtype: Literal["bfloat16", "float32"] = Field(
        "float32", description="dtype of the published tensors (float32: the master weights, unrounded)"
    )


class CommonTrainConfig(BaseConfig):
    """Sections shared by the RL trainer and SFT: model, run directory, optimizer, checkpoints, publishing."""

    model: ModelLoadConfig
    run_dir: Path = Field(Path(DEFAULT_RUN_DIR), description="run directory (rollouts, weights, checkpoints)")
    max_steps: int = Field(..., ge=1, description="optimizer steps to run")
    seq_len: SeqLen = DEFAULT_SEQ_LEN
    seed: int = Field(0, description="torch seed of the trainer processes; SFT data order")
    resume: bool = Field(False, description="continue from the latest checkpoint under run_dir/checkpoints")
    resume_step: int | None = Field(None, ge=1, description="continue from step N's checkpoint")
    optim: OptimConfig = OptimConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    publish: PublishConfig = PublishConfig()
    peak_flops: float | None = Field(
        None, gt=0, description="per-device FLOP/s for MFU; unset = measure a matmul at start"
    )
    logits_chunk_size: int = Field(
        1024, gt=0, description="tokens per LM-head chunk (bounds [chunk, vocab] memory)"
    )
    fp8: FP8Config = Field(
        FP8Config(), description="block-scale FP8 training (match an FP8 inference server)"
    )
    parallel: ParallelConfig = Field(
        ParallelConfig(), description="FSDP2 / EP / CP degrees under torchrun (docs/scaling.md)"
    )


class RLTrainerConfig(CommonTrainConfig):
    """`asyncrl trainer`: consume rollouts/step_n, produce weights/step_n."""

    loss: LossConfig = Field(
        default_factory=TrustRegionLossConfig,
        description="policy-gradient loss; `variant` picks one (default trust_region) and each variant "
        "takes only its own keys (docs/trainer.md)",
    )
    router_replay: bool = Field(
        True, description="replay the inference engine's expert choices when a sample carries them"
    )
    batch_timeout_s: float = Field(600.0, gt=0, description="how long to wait for rollouts/step_n")
    mismatch: MismatchConfig = Field(
        MismatchConfig(), description="per-step mismatch metrics and the max_mismatch_kl gate"
    )
    weights: WeightsConfig = Field(
        default_factory=FilesystemWeightsConfig,
        description="how each version reaches the servers: files (publish) or buckets over process "
        "groups (docs/weights-transfer.md); distributed needs weights.endpoint",
    )

    @model_validator(mode="after")
    def _check_weights(self) -> RLTrainerConfig:
        if self.weights.transport == "distributed" and self.weights.endpoint is None:
            raise ValueError(
                "weights.transport = 'distributed' needs weights.endpoint (host:port where trainer rank 0 "
                "hosts the weights store; `asyncrl rl` sets it)"
            )
        return self

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

    path: Path = Field(description="JSONL file of chat or prompt-completion rows")
    batch_size: int = Field(8, ge=1, description="sequences per optimizer step (over all ranks)")
    shuffle: bool = Field(True, description="shuffle rows each epoch (under `seed`)")


class SFTStopConfig(BaseConfig):
    """Stop before max_steps once the mean loss of the last `window` steps is at most `loss`.

    A step's loss is measured before the update on rows the model has not trained on yet, as long as
    max_steps * batch_size stays within one pass over the data: it is then a held-out loss, and a
    threshold that only a learned skill reaches ends the run when the skill is there, wherever the
    run's numerics put that point. max_steps stays the cap. The last step is published and
    checkpointed as the final one.
    """

    loss: float | None = Field(
        None, gt=0, description="stop once the windowed mean loss is at most this (None: run max_steps)"
    )
    window: int = Field(25, ge=1, description="steps in the mean loss (one batch alone is noisy)")


class SFTConfig(CommonTrainConfig):
    """`asyncrl sft`: cross-entropy on chat / prompt-completion data, same outputs as the RL trainer."""

    data: SFTDataConfig
    stop: SFTStopConfig = Field(
        default_factory=SFTStopConfig, description="early stop at a loss threshold (max_steps is the cap)"
    )
    sinks: SinksConfig = Field(
        default_factory=SinksConfig, description="W&B / TensorBoard mirrors of metrics.jsonl"
    )
    publish: SFTPublishConfig = SFTPublishConfig()
