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
Each section is typed (`InferenceSection`, ...: the process's keys less the shared ones), so an
unknown or mistyped key fails as the file is read; checks across keys run in `resolve()`.
The trainer publishes weights in the servers' format: `[trainer.publish] dtype`, `fp8` and
`fp8_ignore` come from `[inference] dtype`, `fp8.enabled` and `fp8.ignore`. `[weights]` chooses how
each version reaches the servers (`transport`, asyncrl.config.weights); files are the default.
It also rejects combinations that the processes would accept one by one and then fail on or train
badly with: an env's `max_total_tokens` above `seq_len` or above the servers' context limit,
`max_async_steps` above `max_off_policy_steps` (checked by `OrchestratorConfig`), and
`[trainer.publish] interval` above `max_async_steps + 1` (checked here). The orchestrator's
`trainer_dp_size` (the parts each batch is written in) comes from `[trainer.parallel]` and the
trainer's world size.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from pydantic import Field, ValidationInfo, field_validator, model_validator

from asyncrl.config.base import BaseConfig, ConfigError, load_config, section_of
from asyncrl.config.inference import InferenceConfig, is_loopback
from asyncrl.config.orchestrator import OrchestratorConfig
from asyncrl.config.parallel import ParallelConfig
from asyncrl.config.shared import DEFAULT_RUN_DIR, DEFAULT_SEQ_LEN, SeqLen
from asyncrl.config.sinks import SinksConfig
from asyncrl.config.trainer import RLTrainerConfig
from asyncrl.config.weights import FilesystemWeightsConfig, WeightsConfig
from asyncrl.run_dir import weights_root

__all__ = [
    "DeploymentConfig",
    "InferenceSection",
    "OrchestratorSection",
    "RLConfig",
    "ResolvedRL",
    "TrainerSection",
]

# section -> keys that resolve() fills in (dotted for nested ones)
_SHARED = {
    "inference": ("model", "host", "port", "seed", "api_key", "weights", "weights_server"),
    "orchestrator": (
        "model",
        "run_dir",
        "max_steps",
        "servers",
        "prefill_servers",
        "seed",
        "api_key",
        "inference_backend",
        "seq_len",
        "max_model_len",
        "trainer_dp_size",
        "weights_transport",
    ),
    "trainer": (
        "run_dir",
        "max_steps",
        "seq_len",
        "seed",
        "model.path",
        "publish.dtype",
        "publish.fp8",
        "publish.fp8_ignore",
        "weights",
    ),
}
# where a shared key comes from, when not from the top-level key of its name
_SOURCE = {
    "host": "from [deployment] host",
    "port": "from [deployment] base_port",
    "servers": "from [deployment] host, base_port and num_inference_servers",
    "prefill_servers": 'from [deployment] and [inference] deployment = "disaggregated"',
    "inference_backend": "from [inference] backend",
    "max_model_len": "from [inference] max_model_len",
    "trainer_dp_size": "from [trainer.parallel] and the trainer's world size ([deployment] trainer_nproc)",
    "model.path": "from the top-level model",
    "publish.dtype": "from [inference] dtype",
    "publish.fp8": "from [inference] fp8.enabled",
    "publish.fp8_ignore": "from [inference] fp8.ignore",
    "weights": "from the top-level [weights]",
    "weights_server": "server<i>, from the server's index",
    "weights_transport": "from [weights] transport",
}

InferenceSection = section_of(InferenceConfig, _SHARED["inference"])
OrchestratorSection = section_of(OrchestratorConfig, _SHARED["orchestrator"])
TrainerSection = section_of(RLTrainerConfig, _SHARED["trainer"])


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
    run_dir: str = Field(
        DEFAULT_RUN_DIR, description="run directory: configs, logs, rollouts, weights, metrics"
    )
    max_steps: int = Field(10, ge=1, description="trainer steps (= rollout batches = policy versions)")
    seq_len: SeqLen = DEFAULT_SEQ_LEN
    seed: int = Field(0, description="base seed; inference server i gets seed + i")
    api_key: str | None = Field(
        None,
        description="key of the inference servers, handed to the orchestrator; the launcher generates "
        "one per run when a server binds a non-loopback address",
    )
    deployment: DeploymentConfig = Field(default_factory=DeploymentConfig)
    weights: WeightsConfig = Field(
        default_factory=FilesystemWeightsConfig,
        description="how each policy version reaches the servers: files or buckets over process groups",
    )
    sinks: SinksConfig = Field(
        default_factory=SinksConfig,
        description="W&B / TensorBoard mirrors of metrics.jsonl (the launcher feeds them)",
    )
    inference: InferenceSection = Field(  # type: ignore[valid-type]
        default_factory=InferenceSection, description="every inference server's keys (InferenceConfig)"
    )
    orchestrator: OrchestratorSection = Field(  # type: ignore[valid-type]
        default_factory=OrchestratorSection, description="the orchestrator's keys (OrchestratorConfig)"
    )
    trainer: TrainerSection = Field(  # type: ignore[valid-type]
        default_factory=TrainerSection, description="the trainer's keys (RLTrainerConfig)"
    )

    @field_validator("inference", "orchestrator", "trainer", mode="before")
    @classmethod
    def _no_shared_keys(cls, table: Any, info: ValidationInfo) -> Any:
        """A shared key in a section is not unknown, only misplaced: say where it is set."""
        section = info.field_name
        assert section is not None
        clash = [key for key in _SHARED[section] if _has_key(table, key)]
        if clash:
            where = ", ".join(f"{key} ({_SOURCE.get(key, 'a top-level key')})" for key in clash)
            raise ValueError(
                f"sets {where}: every process gets these from there; remove them from [{section}]"
            )
        return table

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

    def with_weights_endpoint(self, host: str, port: int) -> RLConfig:
        """This config with `[weights] endpoint` at host:port when the distributed transport needs one
        and none is set (the launcher picks the port); otherwise unchanged."""
        w = self.weights
        if w.transport != "distributed" or w.endpoint is not None:
            return self
        return self.model_copy(update={"weights": w.model_copy(update={"endpoint": f"{host}:{port}"})})

    def resolve(self, *, trainer_world_size: int | None = None) -> ResolvedRL:
        """Each process's full config, with the shared keys filled in; errors name the section.

        `trainer_world_size` is the trainer's process count: `deployment.trainer_nproc` unless
        given (`asyncrl slurm` gives its trainer nodes' GPUs).
        """
        d = self.deployment
        world_size = d.trainer_nproc if trainer_world_size is None else trainer_world_size
        inference = [
            _section(
                InferenceConfig,
                "inference",
                {"update_weights_roots": [str(weights_root(self.run_dir).resolve())]}
                | _set_keys(self.inference)
                | {
                    "model": self.model,
                    "host": d.host,
                    "port": d.base_port + i,
                    "seed": self.seed + i,
                    "api_key": self.api_key,
                    "weights": self.weights.model_dump(),
                    "weights_server": f"server{i}",
                },
            )
            for i in range(d.num_inference_servers)
        ]
        orchestrator = _section(
            OrchestratorConfig,
            "orchestrator",
            self._routing_replay(inference[0])
            | _set_keys(self.orchestrator)
            | {
                "inference_backend": inference[0].backend,
                "model": self.model,
                "run_dir": self.run_dir,
                "max_steps": self.max_steps,
                "servers": self.server_urls,
                "prefill_servers": self._prefill_urls(inference[0]),
                "seed": self.seed,
                "api_key": self.api_key,
                "seq_len": self.seq_len,
                "max_model_len": min(_context_lens(inference), default=None),
                "trainer_dp_size": _trainer_dp_size(self.trainer.parallel, world_size),
                "weights_transport": self.weights.transport,
            },
        )
        trainer_keys = _set_keys(self.trainer)
        trainer = _section(
            RLTrainerConfig,
            "trainer",
            trainer_keys
            | {
                "model": trainer_keys.get("model", {}) | {"path": self.model},
                "publish": trainer_keys.get("publish", {}) | _serving_format(inference[0]),
                "run_dir": self.run_dir,
                "max_steps": self.max_steps,
                "seq_len": self.seq_len,
                "seed": self.seed,
                "weights": self.weights.model_dump(),
            },
        )
        _check_publish_interval(trainer, orchestrator)
        return ResolvedRL(inference=inference, orchestrator=orchestrator, trainer=trainer)

    def _prefill_urls(self, inference: InferenceConfig) -> list[str]:
        """Where each server's prefill server would listen on one machine (after the decode servers'
        ports); `asyncrl rl --slurm` gives the orchestrator the job's own at start."""
        if inference.deployment != "disaggregated":
            return []
        d, n = self.deployment, self.deployment.num_inference_servers
        return [f"http://{d.host}:{d.base_port + n + i}" for i in range(n)]

    def _routing_replay(self, inference: InferenceConfig) -> dict[str, Any]:
        """Router replay needs servers that return routed experts: a vLLM server does only with
        `enable_return_routed_experts` (GPU builds). Without it replay is off by default, and
        asking for it is an error (`asyncrl rl` says so at start either way)."""
        if inference.backend != "vllm" or inference.vllm.enable_return_routed_experts:
            return {}
        asked = "return_routed_experts" in self.orchestrator.model_fields_set
        if asked and self.orchestrator.return_routed_experts:
            raise ConfigError(
                "[orchestrator] return_routed_experts = true needs [inference.vllm] "
                "enable_return_routed_experts = true (a GPU build of vLLM)"
            )
        return {"return_routed_experts": False}


def _serving_format(inference: InferenceConfig) -> dict[str, Any]:
    """The trainer publishes what the servers serve: their dtype (float32 keeps a float32 run exactly
    on-policy), in FP8 blocks when they run FP8."""
    return {"dtype": inference.dtype, "fp8": inference.fp8.enabled, "fp8_ignore": inference.fp8.ignore}


def _context_lens(inference: list[InferenceConfig]) -> list[int]:
    """The servers' known context limits (none while the model directory does not exist yet)."""
    return [n for n in (cfg.context_len() for cfg in inference) if n is not None]


def _trainer_dp_size(parallel: ParallelConfig, world_size: int) -> int:
    """The trainer's data ranks, dp_replicate * dp_shard (CP ranks of one group read one part).

    dp_shard = -1 takes what the world size leaves; a layout that does not fit the world size is
    rejected by the launcher's check (asyncrl.distributed.ParallelDims) before anything starts.
    """
    dp_shard = parallel.dp_shard
    if dp_shard == -1:
        dp_shard = max(1, world_size // (parallel.dp_replicate * parallel.cp))
    return parallel.dp_replicate * dp_shard


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


def _has_key(table: Any, dotted: str) -> bool:
    head, _, rest = dotted.partition(".")
    if not isinstance(table, dict) or head not in table:
        return False
    return not rest or _has_key(table[head], rest)


def _set_keys(section: BaseConfig) -> dict[str, Any]:
    """The keys a section sets (nested tables too), for resolve() to lay over its defaults."""
    return section.model_dump(exclude_unset=True)


def _section(cls, name: str, data: dict[str, Any]):
    return load_config(cls, data, prefix=f"{name}.")
