"""Config of the vLLM inference backend: `[inference.vllm]`, mapped to vLLM's own engine arguments.

Example (inside an `asyncrl rl` config)::

    [inference]
    backend = "vllm"
    dtype = "bfloat16"
    max_num_seqs = 64

    [inference.vllm]
    tensor_parallel_size = 1
    data_parallel_size = 1                     # replicas behind one server: a DP group
    data_parallel_size_local = 1               # of them per node (`--slurm`: a group spans nodes)
    enable_expert_parallel = false
    quantization = "fp8"                       # optional
    kv_transfer_config = { kv_connector = "NixlConnector", kv_role = "kv_both" }   # optional
    extra_args = ["--enforce-eager"]

Every key here has one vLLM flag (`asyncrl.launcher.vllm.FLAG_MAP`, the table in
docs/inference.md), but the multi-node keys (`data_parallel_size_local`, `data_parallel_rpc_port`),
which the Slurm job renders per node; unknown keys are errors. `extra_args` is passed through
verbatim, for flags asyncrl has no key for. `kv_offloading_size_gb` is vLLM's own CPU offload of
the KV cache, which takes the place of a `kv_transfer_config` connector (so not with one). vLLM
runs from its own interpreter (`python`), never from asyncrl's environment: `bash
scripts/setup-vllm.sh` creates it.

A data-parallel group of `data_parallel_size` engines is one server: `data_parallel_size_local` of
them per node, each on tensor_parallel_size x pipeline_parallel_size GPUs. Under `asyncrl rl
--slurm` a group larger than one node's share runs as a head (the HTTP server and its local
engines) and headless followers on the next nodes (asyncrl.launcher.slurm_inference).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from asyncrl.config.base import BaseConfig

__all__ = ["DEFAULT_VLLM_PYTHON", "VLLMConfig"]

DEFAULT_VLLM_PYTHON = ".venv-vllm/bin/python"


class VLLMConfig(BaseConfig):
    """vLLM engine arguments asyncrl knows, plus pass-through `extra_args`."""

    python: str | None = Field(
        None,
        description=f"interpreter with vLLM installed; default: {DEFAULT_VLLM_PYTHON} if it exists, "
        "else the current one",
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="GPUs per model replica that split each layer (--tensor-parallel-size)"
    )
    pipeline_parallel_size: int = Field(
        1, ge=1, description="pipeline stages per replica (--pipeline-parallel-size)"
    )
    data_parallel_size: int = Field(1, ge=1, description="replicas behind one server (--data-parallel-size)")
    data_parallel_size_local: int | None = Field(
        None,
        ge=1,
        description="replicas per node (--data-parallel-size-local); default: all of them on one node; "
        "fewer spread the group over data_parallel_size / data_parallel_size_local nodes (--slurm only)",
    )
    data_parallel_rpc_port: int = Field(
        13345,
        ge=1,
        le=65535,
        description="a multi-node group's handshake port on its head node (--data-parallel-rpc-port); the "
        "j-th group headed on a node uses this + j",
    )
    enable_expert_parallel: bool = Field(
        False, description="shard routed experts over the TP x DP ranks (--enable-expert-parallel)"
    )
    quantization: str | None = Field(None, description="e.g. 'fp8'; vLLM's --quantization")
    kv_transfer_config: dict[str, Any] | None = Field(
        None, description="P/D or KV-offload connector, passed to vLLM's --kv-transfer-config as JSON"
    )
    kv_offloading_size_gb: float | None = Field(
        None,
        gt=0.0,
        description="vLLM's own KV offload to CPU memory, GiB per server (--kv-offloading-size); "
        "off when unset",
    )
    kv_offloading_backend: Literal["native", "lmcache"] = Field(
        "native",
        description="what offloads the KV cache (--kv-offloading-backend), with kv_offloading_size_gb",
    )
    gpu_memory_utilization: float | None = Field(
        None, gt=0.0, le=1.0, description="fraction of device memory vLLM may take; default vLLM's"
    )
    cpu_kv_cache_space_gb: int | None = Field(
        None,
        ge=1,
        description="CPU build only: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE); default: max_num_seqs "
        "sequences of max_model_len tokens of the model's KV, at most a quarter of the memory available "
        "at start (docs/inference.md)",
    )
    enforce_eager: bool = Field(False, description="no CUDA graphs / compilation (--enforce-eager)")
    enable_return_routed_experts: bool = Field(
        False, description="return routed experts for router replay (GPU builds of vLLM only)"
    )
    startup_timeout_s: float = Field(900.0, gt=0.0, description="compatibility probe and start-up budget")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment of the vLLM process")
    extra_args: list[str] = Field(default_factory=list, description="more vLLM flags, passed verbatim")

    @field_validator("extra_args")
    @classmethod
    def _no_context_len(cls, extra_args: list[str]) -> list[str]:
        """The context limit has one key, `[inference] max_model_len`, which asyncrl checks against every
        env's episode budget and caps requests by; a flag here would override it unseen."""
        for arg in extra_args:
            if arg.split("=")[0].replace("_", "-") == "--max-model-len":
                raise ValueError(
                    f"extra_args sets {arg.split('=')[0]}: set [inference] max_model_len instead (asyncrl "
                    "checks it against the environments' max_total_tokens and caps requests by it)"
                )
        return extra_args

    @model_validator(mode="after")
    def _check_data_parallel(self) -> VLLMConfig:
        local = self.data_parallel_size_local
        if local is not None and self.data_parallel_size % local:
            raise ValueError(
                f"data_parallel_size_local ({local}) must divide data_parallel_size "
                f"({self.data_parallel_size}): every node of a group runs the same number of engines"
            )
        if self.kv_offloading_size_gb is not None and self.kv_transfer_config:
            # vLLM 0.32 turns --kv-offloading-size into its own connector, in place of the given one
            raise ValueError(
                "kv_offloading_size_gb replaces kv_transfer_config's connector in vLLM: offload through the "
                "connector instead, e.g. a MultiConnector of your connector and { kv_connector = "
                '"OffloadingConnector", kv_role = "kv_both", kv_connector_extra_config = { cpu_bytes_to_use '
                "= BYTES } }"
            )
        return self

    @property
    def engines_per_node(self) -> int:
        """Data-parallel engines of one group on each of its nodes."""
        return self.data_parallel_size_local or self.data_parallel_size

    @property
    def nodes_per_group(self) -> int:
        """Nodes one data-parallel group spans."""
        return self.data_parallel_size // self.engines_per_node

    @property
    def gpus_per_node(self) -> int:
        """GPUs a group takes on each of its nodes: its local engines, each tensor x pipeline parallel."""
        return self.engines_per_node * self.tensor_parallel_size * self.pipeline_parallel_size
