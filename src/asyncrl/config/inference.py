"""Config of the embedded inference server (`asyncrl inference @ cfg.toml --model DIR --port 8000`).

Example::

    model = "outputs/tiny-moe"
    port = 8000
    dtype = "float32"          # exact on-policy mode: logprobs equal asyncrl.model's
    max_num_seqs = 64
    kv_cache_tokens = 32768    # paged KV pool size, in tokens (rounded up to whole blocks)

`deployment = "disaggregated"` (vLLM only) splits each server into a prefill server and a decode
server that hands over the prompt's KV through `[inference.vllm] kv_transfer_config`;
`[inference.prefill]` holds the prefill servers' vLLM keys (default: the decode servers'). The
orchestrator sees each pair as one server (asyncrl.client.disaggregated).
"""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from asyncrl.config.base import BaseConfig
from asyncrl.config.fp8 import FP8Config
from asyncrl.config.shared import Device
from asyncrl.config.vllm import VLLMConfig
from asyncrl.config.weights import FilesystemWeightsConfig, WeightsConfig

__all__ = ["Deployment", "InferenceConfig", "Role", "is_loopback"]

Deployment = Literal["colocated", "disaggregated"]
Role = Literal["serve", "prefill", "decode"]

# What the embedded engine assumes when config.json does not say (asyncrl.model.ModelArgs).
_DEFAULT_MAX_POSITION_EMBEDDINGS = 32768


class InferenceConfig(BaseConfig):
    """Engine and HTTP server settings. Only `model` is required."""

    model: str = Field(description="Hugging Face model directory (config.json, safetensors, tokenizer)")
    backend: Literal["embedded", "vllm"] = Field(
        "embedded",
        description="'embedded': asyncrl's engine; 'vllm': a vLLM OpenAI server (docs/inference.md)",
    )
    served_model_name: str | None = Field(None, description="name clients pass as `model`; default: dir name")
    host: str = Field("127.0.0.1", description="address to bind; 0.0.0.0 serves other machines")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port")
    api_key: str | None = Field(
        None, description="when set, requests need `Authorization: Bearer KEY`; required off loopback"
    )
    update_weights_roots: list[str] | None = Field(
        None,
        description="/update_weights loads only from directories under these; None: anywhere "
        "(allowed on loopback only)",
    )
    max_request_bytes: int = Field(16 * 2**20, ge=1024, description="larger request bodies get 413")
    allow_request_chat_template: bool = Field(
        False, description="let chat requests carry `chat_template` (rendered sandboxed, time and size bound)"
    )
    chat_template_timeout_s: float = Field(1.0, gt=0, description="time bound of a request's chat template")
    chat_template_max_chars: int = Field(
        1_000_000, ge=1, description="size bound of a rendered chat template"
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="weights and compute; float32 with a float32 trainer is exactly on-policy"
    )
    device: Device = Field("auto", description="auto = cuda when available, else cpu")
    max_num_seqs: int = Field(64, ge=1, description="most sequences in the running batch")
    max_num_batched_tokens: int = Field(2048, ge=16, description="token budget of one engine step")
    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV-cache block")
    kv_cache_tokens: int = Field(32768, ge=16, description="KV pool capacity in tokens")
    decode_buffer_tokens: int | None = Field(
        None,
        ge=0,
        description="dense per-sequence K/V rows for decode attention, in tokens (rows x positions); "
        "past it decode gathers from the paged pool each step; default: kv_cache_tokens",
    )
    max_model_len: int | None = Field(
        None,
        ge=2,
        description="context limit (prompt + completion); default: the model's max_position_embeddings",
    )
    enable_prefix_caching: bool = Field(True, description="reuse KV blocks of shared prompt prefixes")
    cpu_packed_weights: bool = Field(
        True,
        description="on a CPU, compute with oneDNN-packed copies of the weights of 65536+ elements "
        "(faster decode; as much memory again as those weights); false: for the whole process",
    )
    cpu_decode_kernel: bool = Field(
        True,
        description="on a CPU, per-head K/V decode attention through a small C kernel built "
        "with the system's compiler on first use (each sequence read to its own length); false, or "
        "no compiler: SDPA",
    )
    cpu_matmul_kernel: bool = Field(
        True,
        description="on a CPU with AVX-512, the MoE experts and the linears of decode-sized steps "
        "through a small C kernel built with the system's compiler on first use (AVX-512 BF16 for "
        "bf16); false, or no compiler: torch's matmuls",
    )
    seed: int = Field(0, description="seed of the engine's generator for requests without a seed")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="server log level")
    fp8: FP8Config = Field(
        default_factory=FP8Config, description="FP8 block-scale inference (docs/mismatch.md)"
    )
    vllm: VLLMConfig = Field(
        default_factory=VLLMConfig, description="vLLM engine arguments (backend = 'vllm' only)"
    )
    deployment: Deployment = Field(
        "colocated",
        description="'colocated': each server prefills and decodes; 'disaggregated' (vLLM): each server is a "
        "prefill server and a decode server, the prompt's KV handed over by the kv_transfer_config connector",
    )
    prefill: VLLMConfig | None = Field(
        None, description="disaggregated only: the prefill servers' vLLM keys; default: [inference.vllm]"
    )
    weights: WeightsConfig = Field(
        default_factory=FilesystemWeightsConfig,
        description="how new weights arrive: files named by /update_weights, or (distributed) versions "
        "received from the trainer through `endpoint`, staged while serving",
    )
    weights_server: str = Field(
        "server0", description="this server's name on the weights endpoint (one per server of a run)"
    )

    @model_validator(mode="after")
    def _check_exposure(self) -> InferenceConfig:
        if is_loopback(self.host):
            return self
        if not self.api_key:
            raise ValueError(
                f"host = {self.host!r} is reachable from other machines: set api_key "
                "(`asyncrl rl` generates one per run)"
            )
        if self.update_weights_roots is None:
            raise ValueError(
                f"host = {self.host!r} is reachable from other machines: set update_weights_roots "
                "(the directories /update_weights may load from)"
            )
        return self

    @model_validator(mode="after")
    def _check_deployment(self) -> InferenceConfig:
        if self.deployment == "colocated":
            if self.prefill is not None:
                raise ValueError(
                    '[inference.prefill] is for deployment = "disaggregated"; remove it or set the deployment'
                )
            return self
        if self.backend != "vllm":
            raise ValueError(
                'deployment = "disaggregated" needs backend = "vllm": the embedded engine has no KV connector'
            )
        for role in ("prefill", "decode"):
            v = self.role_config(role).vllm
            if not v.kv_transfer_config:
                where = "[inference.prefill]" if role == "prefill" and self.prefill else "[inference.vllm]"
                raise ValueError(
                    f'deployment = "disaggregated": the {role} servers need a KV connector: set {where} '
                    'kv_transfer_config, e.g. { kv_connector = "NixlConnector", kv_role = "kv_both" }'
                )
            if v.enable_return_routed_experts:
                raise ValueError(
                    'deployment = "disaggregated" does not return routed experts yet (the prompt\'s routing '
                    "is on the prefill server, the completion's on the decode server): turn "
                    "enable_return_routed_experts off"
                )
        return self

    def role_config(self, role: Role) -> InferenceConfig:
        """The config of a server in `role`: a prefill server runs `prefill` (else `vllm`)."""
        if role != "prefill" or self.prefill is None:
            return self
        return self.model_copy(update={"vllm": self.prefill})

    @model_validator(mode="after")
    def _check_weights(self) -> InferenceConfig:
        if self.weights.transport == "distributed" and self.weights.endpoint is None:
            raise ValueError(
                "weights.transport = 'distributed' needs weights.endpoint (host:port of the trainer's "
                "weights store; `asyncrl rl` sets it)"
            )
        if not self.weights_server or "/" in self.weights_server:
            raise ValueError(
                f"weights_server must be a non-empty name without '/', got {self.weights_server!r}"
            )
        return self

    def context_len(self) -> int | None:
        """The server's context limit: `max_model_len`, else the model's `max_position_embeddings`
        (as the embedded engine reads it; vLLM derives its default from the same config.json, so set
        `max_model_len` to be exact); None while the model directory has no readable config.json."""
        if self.max_model_len is not None:
            return self.max_model_len
        try:
            hf_config = json.loads(Path(self.model, "config.json").read_text())
        except (OSError, json.JSONDecodeError):
            return None
        return int(hf_config.get("max_position_embeddings", _DEFAULT_MAX_POSITION_EMBEDDINGS))


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a server reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost may resolve anywhere
        return False
