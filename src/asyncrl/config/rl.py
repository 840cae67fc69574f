"""`asyncrl rl` config: one TOML composing inference, orchestrator and trainer, plus shared keys.

    model = "outputs/demo/sft"     # shared: served, trained, and used for the tokenizer
    run_dir = "outputs/demo/rl"
    max_steps = 20
    seq_len = 1024

    [deployment]
    num_inference_servers = 1

    [inference]
    max_num_seqs = 64

    [orchestrator]
    batch_size = 64
    group_size = 8

    [trainer]
    optim = { lr = 3e-4 }

Shared keys are set once, at the top. `resolve()` derives each process's config from them, in one
visible place; a section that sets a shared key itself is an error (not silently overwritten).
It also rejects combinations that the processes would accept one by one and then fail on or train
badly with: an env's `max_total_tokens` above `seq_len` or above the servers' context limit,
`max_async_steps` above `max_off_policy_steps` (checked by `OrchestratorConfig`), and
`[trainer.publish] interval` above `max_async_steps + 1` (checked here).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from pydantic import Field, model_validator

from asyncrl.config.base import BaseConfig, ConfigError, load_config
from asyncrl.config.inference import InferenceConfig, is_loopback
from asyncrl.config.orchestrator import OrchestratorConfig
from asyncrl.config.sinks import SinksConfig
from asyncrl.config.trainer import RLTrainerConfig
from asyncrl.run_dir import weights_root

__all__ = ["DeploymentConfig", "RLConfig", "ResolvedRL"]

# section -> keys that come from the top level
_SHARED = {
    "inference": ("model", "port", "seed", "api_key"),
    "orchestrator": (
        "model",
        "run_dir",
        "max_steps",
        "servers",
        "seed",
        "api_key",
        "inference_backend",
        "seq_len",
        "max_model_len",
    ),
    "trainer": ("run_dir", "max_steps", "seq_len", "seed"),  # [trainer.model] may set dtype/device
}


class DeploymentConfig(BaseConfig):
    """Where the processes run. On one machine: servers on consecutive ports from `base_port`."""

    num_inference_servers: int = Field(1, ge=1, description="inference servers to start")
    host: str = Field("127.0.0.1", description="address the servers bind and the orchestrator calls")
    base_port: int = Field(8000, ge=1, le=65535, description="port of server 0; server i uses base_port + i")
    trainer_nproc: int = Field(1, ge=1, description="trainer processes; > 1 launches through torchrun")
    inference_devices: list[str] = Field(
        default_factory=list, description="CUDA_VISIBLE_DEVICES per server, e.g. ['0', '1']; empty = inherit"
    )
    trainer_devices: str | None = Field(None, description="CUDA_VISIBLE_DEVICES of the trainer, e.g. '2,3'")
    max_inference_restarts: int = Field(
        3, ge=0, description="restarts of a failed inference server before the run stops"
    )

    @model_validator(mode="after")
    def _check(self) -> DeploymentConfig:
        if self.inference_devices and len(self.inference_devices) != self.num_inference_servers:
            raise ValueError(
                f"deployment.inference_devices lists {len(self.inference_devices)} entries but "
                f"num_inference_servers is {self.num_inference_servers}"
            )
        return self


@dataclass(frozen=True, kw_only=True)
class ResolvedRL:
    inference: list[InferenceConfig]
    orchestrator: OrchestratorConfig
    trainer: RLTrainerConfig


class RLConfig(BaseConfig):
    model: str = Field(description="HF model directory: served by inference, trained by the trainer")
    run_dir: str = Field("outputs/rl", description="run directory: configs, logs, rollouts, weights, metrics")
    max_steps: int = Field(10, ge=1, description="trainer steps (= rollout batches = policy versions)")
    seq_len: int = Field(2048, gt=0, description="trainer: max tokens in one packed micro-batch row")
    seed: int = Field(0, description="base seed; inference server i gets seed + i")
    api_key: str | None = Field(
        None,
        description="key of the inference servers, handed to the orchestrator; the launcher generates "
        "one per run when a server binds a non-loopback address",
    )
    deployment: DeploymentConfig = Field(default_factory=DeploymentConfig)
    sinks: SinksConfig = Field(
        default_factory=SinksConfig,
        description="W&B / TensorBoard mirrors of metrics.jsonl (the launcher feeds them)",
    )
    inference: dict[str, Any] = Field(default_factory=dict, description="InferenceConfig keys")
    orchestrator: dict[str, Any] = Field(default_factory=dict, description="OrchestratorConfig keys")
    trainer: dict[str, Any] = Field(default_factory=dict, description="RLTrainerConfig keys")

    @property
    def server_urls(self) -> list[str]:
        d = self.deployment
        return [f"http://{d.host}:{d.base_port + i}" for i in range(d.num_inference_servers)]

    def with_run_api_key(self, *, exposed: bool) -> RLConfig:
        """This config with a fresh random api_key when servers are `exposed` (or bind off loopback)
        and none is set; otherwise unchanged."""
        if self.api_key is not None or not (exposed or not is_loopback(self.deployment.host)):
            return self
        return self.model_copy(update={"api_key": secrets.token_urlsafe(32)})

    def resolve(self) -> ResolvedRL:
        """Each process's full config, with the shared keys filled in; errors name the section."""
        for section, keys in _SHARED.items():
            clash = sorted(set(getattr(self, section)) & set(keys))
            if clash:
                raise ConfigError(
                    f"[{section}] sets {clash}: these come from the top level (or [deployment], or "
                    "[inference] for max_model_len); set them there instead"
                )
        d = self.deployment
        inference = [
            _section(
                InferenceConfig,
                "inference",
                {"update_weights_roots": [str(weights_root(self.run_dir).resolve())]}
                | self.inference
                | {
                    "model": self.model,
                    "host": d.host,
                    "port": d.base_port + i,
                    "seed": self.seed + i,
                    "api_key": self.api_key,
                },
            )
            for i in range(d.num_inference_servers)
        ]
        orchestrator = _section(
            OrchestratorConfig,
            "orchestrator",
            self._routing_replay(inference[0])
            | self.orchestrator
            | {
                "inference_backend": inference[0].backend,
                "model": self.model,
                "run_dir": self.run_dir,
                "max_steps": self.max_steps,
                "servers": self.server_urls,
                "seed": self.seed,
                "api_key": self.api_key,
                "seq_len": self.seq_len,
                "max_model_len": min(_context_lens(inference), default=None),
            },
        )
        trainer_model = dict(self.trainer.get("model", {}))
        if "path" in trainer_model:
            raise ConfigError("[trainer.model] sets 'path': the model comes from the top-level 'model'")
        trainer_model["path"] = self.model
        trainer_cfg = {k: v for k, v in self.trainer.items() if k != "model"}
        trainer = _section(
            RLTrainerConfig,
            "trainer",
            trainer_cfg
            | {
                "model": trainer_model,
                "run_dir": self.run_dir,
                "max_steps": self.max_steps,
                "seq_len": self.seq_len,
                "seed": self.seed,
            },
        )
        _check_publish_interval(trainer, orchestrator)
        return ResolvedRL(inference=inference, orchestrator=orchestrator, trainer=trainer)

    def _routing_replay(self, inference: InferenceConfig) -> dict[str, Any]:
        """Router replay needs servers that return routed experts: a vLLM server does only with
        `enable_return_routed_experts` (GPU builds). Without it replay is off by default, and
        asking for it is an error (`asyncrl rl` says so at start either way)."""
        if inference.backend != "vllm" or inference.vllm.enable_return_routed_experts:
            return {}
        if self.orchestrator.get("return_routed_experts") is True:
            raise ConfigError(
                "[orchestrator] return_routed_experts = true needs [inference.vllm] "
                "enable_return_routed_experts = true (a GPU build of vLLM)"
            )
        return {"return_routed_experts": False}


def _context_lens(inference: list[InferenceConfig]) -> list[int]:
    """The servers' known context limits (none while the model directory does not exist yet)."""
    return [n for n in (cfg.context_len() for cfg in inference) if n is not None]


def _check_publish_interval(trainer: RLTrainerConfig, orchestrator: OrchestratorConfig) -> None:
    """The orchestrator writes batch n only once the servers hold v_{n-1-max_async_steps}, and the
    trainer publishes every `interval` steps: beyond max_async_steps + 1 each waits on the other."""
    interval, lag = trainer.publish.interval, orchestrator.max_async_steps
    if interval > lag + 1:
        raise ConfigError(
            f"[trainer.publish] interval ({interval}) is larger than [orchestrator] max_async_steps + 1 "
            f"({lag + 1}): the trainer would wait for a batch that the orchestrator writes only after "
            f"the next publish, until batch_timeout_s; lower the interval to at most {lag + 1} or raise "
            "max_async_steps"
        )


def _section(cls, name: str, data: dict[str, Any]):
    return load_config(cls, data, prefix=f"{name}.")
