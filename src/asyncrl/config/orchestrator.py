"""Config schema of the orchestrator: rollout groups, batching, staleness bounds, servers.

Example (TOML)::

    run_dir = "outputs/demo"
    model = "outputs/demo/sft"          # tokenizer + chat template
    servers = ["http://127.0.0.1:8000"]
    max_steps = 20
    batch_size = 64                      # samples per trainer step
    group_size = 8                       # rollouts per task (group-relative advantages)
    max_async_steps = 1                  # 0 = synchronous on-policy RL; at most max_off_policy_steps
    max_off_policy_steps = 1
    seq_len = 2048                       # the trainer's: every env's max_total_tokens must fit it
    max_model_len = 4096                 # the servers' context limit (optional): requests are capped to it

    [sampling]                           # RL rollouts: temperature > 0, no top_p / top_k / min_p
    temperature = 1.0
    max_tokens = 32

    [eval]                               # held-out evals while training (asyncrl.config.evaluation)
    interval = 10
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from asyncrl.config.base import BaseConfig
from asyncrl.config.envs import EnvsConfig
from asyncrl.config.evaluation import EvalConfig
from asyncrl.config.sampling import SamplingParams
from asyncrl.config.shared import DEFAULT_RUN_DIR, DEFAULT_SEQ_LEN, SeqLen

__all__ = ["AdvantageConfig", "OrchestratorConfig"]


class AdvantageConfig(BaseConfig):
    """Group-relative advantages: A = r - mean(group) [/ (std(group) + eps)]."""

    normalize_std: bool = Field(False, description="divide by the group's reward std (GRPO) as well")
    std_eps: float = Field(1e-6, gt=0.0, description="added to the std before dividing")
    filter_zero_advantage: bool = Field(True, description="drop groups whose rewards are all equal")


class OrchestratorConfig(BaseConfig):
    run_dir: str = Field(DEFAULT_RUN_DIR, description="run directory shared with the trainer")
    model: str = Field(description="model directory whose tokenizer and chat template render prompts")
    servers: list[str] = Field(
        default_factory=lambda: ["http://127.0.0.1:8000"],
        min_length=1,
        description="base URLs of the inference servers",
    )
    prefill_servers: list[str] = Field(
        default_factory=list,
        description="disaggregated deployments: the prefill server of each of `servers` (its decode "
        "server), in the same order; each pair is one server to the pool (asyncrl.client.disaggregated)",
    )
    inference_backend: Literal["embedded", "vllm"] = Field(
        "embedded", description="what the servers are: asyncrl's HTTP API or vLLM's (docs/inference.md)"
    )
    weights_transport: Literal["filesystem", "distributed"] = Field(
        "filesystem",
        description="how the servers get each version: they load its files, or take the one the trainer "
        "sent them (docs/weights-transfer.md)",
    )
    api_key: str | None = Field(None, description="sent as `Authorization: Bearer KEY` to the servers")
    envs: EnvsConfig = Field(default_factory=EnvsConfig, description="the environment mixture")
    sampling: SamplingParams = Field(
        default_factory=lambda: SamplingParams(max_tokens=64), description="sampling of every rollout request"
    )
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    eval: EvalConfig = Field(
        default_factory=EvalConfig, description="held-out evals every N policy versions (off by default)"
    )
    max_steps: int = Field(10, ge=1, description="last trainer step to produce a batch for")
    start_step: int = Field(1, ge=1, description="first batch to write (resume: the trainer's next step)")
    resume: bool = Field(
        False,
        description="continue from the checkpoint written with the newest RUN/rollouts/step_n "
        "(start_step is then ignored); a fresh start if there is none",
    )
    batch_size: int = Field(32, ge=1, description="samples per batch (one trainer step)")
    group_size: int = Field(4, ge=1, description="rollouts per task")
    max_concurrent_groups: int | None = Field(
        None, ge=1, description="groups in flight at once; default: enough for (1 + max_async_steps) batches"
    )
    max_async_steps: int = Field(
        1,
        ge=0,
        description="batches the orchestrator may run ahead of the trainer; at most max_off_policy_steps",
    )
    max_off_policy_steps: int = Field(
        1, ge=0, description="k: at step n, drop samples with a token older than version n-1-k"
    )
    seq_len: SeqLen = DEFAULT_SEQ_LEN  # the trainer's
    max_model_len: int | None = Field(
        None,
        ge=2,
        description="the servers' context limit (prompt + completion tokens): requests are capped to "
        "fit it, and every env's max_total_tokens must fit it; None: unknown (a request the servers "
        "refuse for its length then ends the episode as a length stop)",
    )
    trainer_dp_size: int = Field(
        1,
        ge=1,
        description="the trainer's data-parallel ranks (dp_replicate * dp_shard): each batch is written in "
        "this many token-balanced parts, one per rank, so each rank reads only its own",
    )
    return_routed_experts: bool = Field(True, description="ask inference for routing (router replay)")
    max_episode_retries: int = Field(3, ge=0, description="re-runs of an episode whose server failed")
    weights_poll_s: float = Field(
        0.05,
        gt=0.0,
        description="how often to look for new RUN/weights/step_n (as the trainer polls for batches)",
    )
    health_poll_s: float = Field(1.0, gt=0.0, description="how often to probe each server's /health")
    request_timeout_s: float = Field(600.0, gt=0.0, description="HTTP timeout of one inference request")
    server_ready_timeout_s: float = Field(
        600.0, gt=0.0, description="wait at start for every server's /health"
    )
    seed: int = Field(0, description="seed of the environment choice per group")
    fill_status_interval_s: float = Field(
        10.0, gt=0.0, description="while a batch fills, print how full it is and why groups drop this often"
    )
    max_fill_groups: int | None = Field(
        None,
        ge=1,
        description="groups that may finish (or go stale) while one batch fills before the run stops "
        "with an error naming why they were dropped; default 50 x (batch_size / group_size)",
    )

    @field_validator("sampling")
    @classmethod
    def _check_sampling(cls, sampling: SamplingParams) -> SamplingParams:
        """Reject sampling the RL loss cannot honour (eval keeps greedy / top-p: asyncrl eval)."""
        if sampling.temperature == 0:
            raise ValueError(
                "temperature = 0 (greedy) cannot train: the trainer scores each token under "
                "softmax(logits / temperature), which is undefined at 0, so every loss is NaN and every "
                "step is skipped; use a temperature > 0 (e.g. 1.0) for RL rollouts"
            )
        truncating = [
            f"{name} = {value}"
            for name, value, off in (
                ("top_p", sampling.top_p, sampling.top_p == 1.0),
                ("top_k", sampling.top_k, sampling.top_k <= 0),
                ("min_p", sampling.min_p, sampling.min_p == 0.0),
            )
            if not off
        ]
        if truncating:
            raise ValueError(
                f"{', '.join(truncating)} would truncate the distribution tokens are sampled from, but the "
                "engine reports (and the trainer recomputes) logprobs of the full temperature-scaled "
                "distribution, so the importance ratios would be wrong; RL rollouts need top_p = 1, "
                "top_k = -1 and min_p = 0 (shape sampling with temperature only)"
            )
        return sampling

    @model_validator(mode="after")
    def _check(self) -> OrchestratorConfig:
        if self.batch_size % self.group_size:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of group_size ({self.group_size})"
            )
        if self.start_step > self.max_steps:
            raise ValueError(f"start_step ({self.start_step}) is past max_steps ({self.max_steps})")
        if self.group_size == 1 and self.advantage.filter_zero_advantage:
            raise ValueError(
                "group_size = 1 gives every group zero advantage; set advantage.filter_zero_advantage = "
                "false or use group_size >= 2"
            )
        if self.max_async_steps > self.max_off_policy_steps:
            raise ValueError(
                f"max_async_steps ({self.max_async_steps}) is larger than max_off_policy_steps "
                f"({self.max_off_policy_steps}): groups dispatched that far ahead are too old for the batch "
                "they land in, and the batch cut drops them; raise max_off_policy_steps to at least "
                "max_async_steps, or lower max_async_steps"
            )
        if self.prefill_servers and len(self.prefill_servers) != len(self.servers):
            raise ValueError(
                f"prefill_servers lists {len(self.prefill_servers)} servers, servers {len(self.servers)}: "
                "each server (a decode server) needs its own prefill server"
            )
        self._check_episode_budgets()
        if self.eval.enabled:
            self.eval.check(self.envs.envs, self.max_model_len)
        return self

    def _check_episode_budgets(self) -> None:
        """Every episode must fit one packed trainer row and the servers' context."""
        for i, env in enumerate(self.envs.envs):
            budget = f"envs.envs[{i}] ({env.label or env.name}) max_total_tokens ({env.max_total_tokens})"
            if env.max_total_tokens > self.seq_len:
                raise ValueError(
                    f"{budget} is larger than seq_len ({self.seq_len}), the trainer's packed row: a longer "
                    "episode could not be trained; lower max_total_tokens or raise seq_len"
                )
            if self.max_model_len is not None and env.max_total_tokens > self.max_model_len:
                raise ValueError(
                    f"{budget} is larger than max_model_len ({self.max_model_len}), the servers' context "
                    "limit ([inference] max_model_len, else the model's max_position_embeddings): episodes "
                    "would hit the server's limit before their budget; lower max_total_tokens or raise "
                    "the servers' max_model_len"
                )

    @property
    def groups_per_batch(self) -> int:
        return self.batch_size // self.group_size

    @property
    def fill_group_limit(self) -> int:
        return self.max_fill_groups or 50 * self.groups_per_batch

    @property
    def concurrent_groups(self) -> int:
        return self.max_concurrent_groups or self.groups_per_batch * (1 + self.max_async_steps)
