"""The vLLM backend's launcher side: the server command, its environment, and a compatibility check.

`asyncrl rl` with `[inference] backend = "vllm"` starts one vLLM OpenAI server per inference
server, with the interpreter of vLLM's own environment (`bash scripts/setup-vllm.sh`):

    VLLM_SERVER_DEV_MODE=1 .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server \\
        --model DIR --host 127.0.0.1 --port 8000 --dtype bfloat16 --max-num-seqs 64 ... \\
        --enable-scale-out --enable-prefix-caching

Every server also loads asyncrl's worker extension (`vllm_ext/asyncrl_vllm_ext.py`, put on the
server's PYTHONPATH): weight updates call its `asyncrl_reload_weights`, vLLM's in-place reload plus
a repair of the CPU build's MoE expert prepacking (see that module).

With `[weights] transport = "distributed"` every server also gets
`--weight-transfer-config '{"backend": "asyncrl"}'` and the run's weights endpoint in its
environment: the extension registers asyncrl's weight-transfer engine with vLLM under that name,
and each worker receives versions from the trainer while vLLM generates
(`vllm_ext/asyncrl_vllm_receive.py`). That engine imports asyncrl from ASYNCRL_PACKAGE_DIR, this
package's folder (the package alone: vLLM's interpreter keeps its own torch).

`VLLM_SERVER_DEV_MODE=1` turns on vLLM's RL endpoints (`/pause`, `/resume`, `/collective_rpc`,
`/update_weight_version`) that in-flight weight updates use; `--enable-scale-out` turns on the
token-in/token-out `POST /inference/v1/generate`. Both stay on 127.0.0.1 unless `host` says
otherwise; set `api_key` when a server listens on a network.

Before starting, `probe_vllm` runs a short script in that interpreter (vLLM's version, the flags its
server accepts, the architectures it serves, its platform) and `check_vllm` turns any mismatch
into a ConfigError that names the problem.

vLLM's CPU build sizes its KV cache from `--gpu-memory-utilization` of the host's memory (92% by
default) unless `VLLM_CPU_KVCACHE_SPACE` says otherwise; next to a trainer that does not start.
Without `[inference.vllm] cpu_kv_cache_space_gb` the command sets it from the model
(`cpu_kv_cache_default`): the cache of `max_num_seqs` full-length sequences, capped to a fraction
of the memory available on this host; `check_vllm` states the choice on a CPU build. GPU builds
ignore the variable.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncrl
from asyncrl.config import ConfigError, InferenceConfig
from asyncrl.config.inference import is_loopback
from asyncrl.config.vllm import DEFAULT_VLLM_PYTHON
from asyncrl.weight_transfer.endpoint import WeightsEndpoint

__all__ = [
    "CPU_KV_MAX_FRACTION",
    "FLAG_MAP",
    "MIN_VLLM_VERSION",
    "PACKAGE_DIR_ENV",
    "WEIGHT_TRANSFER_BACKEND",
    "WORKER_EXTENSION_CLS",
    "WORKER_EXTENSION_DIR",
    "CPUKVDefault",
    "VLLMCommand",
    "VLLMProbe",
    "available_memory_bytes",
    "build_vllm_command",
    "check_vllm",
    "cpu_kv_cache_default",
    "data_parallel_group_argv",
    "probe_vllm",
    "resolve_vllm_python",
]

MIN_VLLM_VERSION = (0, 32)

# The default CPU KV cache takes at most this share of the memory available when the run starts:
# the trainer (weights, optimizer state, activations), vLLM's own weights and the orchestrator
# share the host with it.
CPU_KV_MAX_FRACTION = 0.25
_GIB = 1 << 30
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# asyncrl's worker extension: a folder holding one module that imports only torch and vLLM.
WORKER_EXTENSION_DIR = Path(__file__).resolve().parent / "vllm_ext"
WORKER_EXTENSION_CLS = "asyncrl_vllm_ext.AsyncRLWorkerExtension"
# The name the extension registers asyncrl's weight-transfer engine under, and where that engine
# finds the asyncrl package (vllm_ext/asyncrl_vllm_receive.py: ENV_PACKAGE).
WEIGHT_TRANSFER_BACKEND = "asyncrl"
PACKAGE_DIR_ENV = "ASYNCRL_PACKAGE_DIR"

# asyncrl key -> vLLM flag (the table in docs/inference.md). Booleans become bare flags.
FLAG_MAP: dict[str, str] = {
    "model": "--model",
    "served_model_name": "--served-model-name",
    "host": "--host",
    "port": "--port",
    "dtype": "--dtype",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "block_size": "--block-size",
    "max_model_len": "--max-model-len",
    "seed": "--seed",
    "vllm.tensor_parallel_size": "--tensor-parallel-size",
    "vllm.pipeline_parallel_size": "--pipeline-parallel-size",
    "vllm.data_parallel_size": "--data-parallel-size",
    "vllm.enable_expert_parallel": "--enable-expert-parallel",
    "vllm.quantization": "--quantization",
    "vllm.kv_transfer_config": "--kv-transfer-config",
    "vllm.kv_offloading_size_gb": "--kv-offloading-size",
    "vllm.kv_offloading_backend": "--kv-offloading-backend",
    "vllm.gpu_memory_utilization": "--gpu-memory-utilization",
    "vllm.enforce_eager": "--enforce-eager",
    "vllm.enable_return_routed_experts": "--enable-return-routed-experts",
}

# Embedded-engine keys that vLLM has no equivalent for: set under backend = "vllm", they warn.
_EMBEDDED_ONLY = (
    "kv_cache_tokens",
    "device",
    "max_request_bytes",
    "allow_request_chat_template",
    "chat_template_timeout_s",
    "chat_template_max_chars",
)

_PROBE = r"""
import json, sys
import vllm
sys.path.insert(0, sys.argv[1])
import asyncrl_vllm_ext  # the worker extension imports in this interpreter
from vllm.platforms import current_platform
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.model_executor.models import ModelRegistry
parser = make_arg_parser(FlexibleArgumentParser())
flags = sorted({s for a in parser._actions for s in a.option_strings if s.startswith("--")})
print(json.dumps({
    "version": vllm.__version__,
    "device_type": str(current_platform.device_type),
    "flags": flags,
    "architectures": sorted(ModelRegistry.get_supported_archs()),
}))
"""


@dataclass(frozen=True, kw_only=True)
class CPUKVDefault:
    """The KV cache size asyncrl gives vLLM's CPU build when the config leaves it unset.
    Example: 4 layers x 2 x 2 heads x 32 dims x 4 B = 2 KiB/token, 128 seqs x 512 tokens: 128 MiB,
    rounded up to whole GiB (VLLM_CPU_KVCACHE_SPACE is an integer): space_gb = 1."""

    bytes_per_token: int  # K and V (or the MLA latent) over all layers, in the serving dtype
    num_tokens: int  # max_num_seqs x max_model_len: every running sequence at full length
    available_bytes: int  # memory available on the launching host
    space_gb: int

    @property
    def capped(self) -> bool:
        return self.space_gb * _GIB < self.bytes_per_token * self.num_tokens

    def describe(self) -> str:
        need = self.bytes_per_token * self.num_tokens / _GIB
        why = (
            f"capped at {CPU_KV_MAX_FRACTION:.0%} of the {self.available_bytes / _GIB:.1f} GiB available; "
            f"{self.space_gb * _GIB // self.bytes_per_token} tokens of the {self.num_tokens} wanted"
            if self.capped
            else f"{self.available_bytes / _GIB:.1f} GiB available"
        )
        return (
            f"vLLM CPU build: KV cache {self.space_gb} GiB (VLLM_CPU_KVCACHE_SPACE) for "
            f"{self.bytes_per_token} B/token x {self.num_tokens} tokens (max_num_seqs x max_model_len) = "
            f"{need:.2f} GiB, {why}; [inference.vllm] cpu_kv_cache_space_gb sets it"
        )


@dataclass(frozen=True, kw_only=True)
class VLLMCommand:
    """One vLLM server: its argv and the environment variables it needs on top of the launcher's."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cpu_kv: CPUKVDefault | None = None  # the default it sets when cpu_kv_cache_space_gb is unset

    def shell(self) -> str:
        """The command as one shell line, to start the server by hand (the API key masked)."""
        env = [
            f"{k}={'<api_key>' if k == 'VLLM_API_KEY' else shlex.quote(v)}"
            for k, v in sorted(self.env.items())
        ]
        return " ".join([*env, shlex.join(self.argv)])


@dataclass(frozen=True, kw_only=True)
class VLLMProbe:
    """What the vLLM interpreter reports about itself (see `probe_vllm`)."""

    version: str
    device_type: str  # "cpu", "cuda", ...
    flags: frozenset[str]
    architectures: frozenset[str]


def resolve_vllm_python(cfg: InferenceConfig, root: Path | None = None) -> str:
    """`[inference.vllm] python`, else .venv-vllm/bin/python under `root` (default: cwd) if it exists,
    else the current interpreter."""
    if cfg.vllm.python:
        return cfg.vllm.python
    default = (root or Path.cwd()) / DEFAULT_VLLM_PYTHON
    return str(default) if default.exists() else sys.executable


def _flag_values(cfg: InferenceConfig) -> list[tuple[str, object]]:
    v = cfg.vllm
    values: dict[str, object] = {
        "model": cfg.model,
        "served_model_name": cfg.served_model_name or Path(cfg.model).name,
        "host": cfg.host,
        "port": cfg.port,
        "dtype": cfg.dtype,
        "max_num_seqs": cfg.max_num_seqs,
        # Only when set: vLLM picks what its attention backend supports (its CPU one: multiples of 32).
        "max_num_batched_tokens": _if_set(cfg, "max_num_batched_tokens"),
        "block_size": _if_set(cfg, "block_size"),
        "max_model_len": cfg.max_model_len,
        "seed": cfg.seed,
        "vllm.tensor_parallel_size": v.tensor_parallel_size,
        "vllm.pipeline_parallel_size": v.pipeline_parallel_size,
        "vllm.data_parallel_size": v.data_parallel_size,
        "vllm.enable_expert_parallel": v.enable_expert_parallel,
        "vllm.quantization": v.quantization,
        "vllm.kv_transfer_config": v.kv_transfer_config,
        "vllm.kv_offloading_size_gb": v.kv_offloading_size_gb,
        "vllm.kv_offloading_backend": v.kv_offloading_backend if v.kv_offloading_size_gb else None,
        "vllm.gpu_memory_utilization": v.gpu_memory_utilization,
        "vllm.enforce_eager": v.enforce_eager,
        "vllm.enable_return_routed_experts": v.enable_return_routed_experts,
    }
    assert values.keys() == FLAG_MAP.keys()
    return list(values.items())


def _if_set(cfg: InferenceConfig, key: str) -> object:
    return getattr(cfg, key) if key in cfg.model_fields_set else None


def available_memory_bytes() -> int:
    """Memory the kernel can give new processes now (MemAvailable: free plus reclaimable cache)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def kv_bytes_per_token(hf_config: dict[str, Any], dtype: str) -> int:
    """Bytes one cached token takes over all layers: K and V per KV head, or MLA's latent and
    rotary key (plus the DSA indexer's key), in `dtype`."""
    layers = int(hf_config["num_hidden_layers"])
    if hf_config.get("kv_lora_rank"):
        per_layer = int(hf_config["kv_lora_rank"]) + int(hf_config["qk_rope_head_dim"])
        per_layer += int(hf_config.get("index_head_dim") or 0)
    else:
        heads = int(hf_config["num_attention_heads"])
        head_dim = int(hf_config.get("head_dim") or int(hf_config["hidden_size"]) // heads)
        per_layer = 2 * int(hf_config.get("num_key_value_heads") or heads) * head_dim
    return layers * per_layer * _DTYPE_BYTES[dtype]


def cpu_kv_cache_default(cfg: InferenceConfig, available_bytes: int) -> CPUKVDefault | None:
    """The KV cache of `max_num_seqs` sequences of the full context, in whole GiB, at most
    CPU_KV_MAX_FRACTION of `available_bytes` and at least 1 GiB; None while the model's
    config.json cannot be read (the compatibility check then stops the run, naming the file)."""
    try:
        hf_config = json.loads(Path(cfg.model, "config.json").read_text())
        per_token = kv_bytes_per_token(hf_config, cfg.dtype)
    except (OSError, json.JSONDecodeError, KeyError, ValueError, TypeError):
        return None
    num_tokens = cfg.max_num_seqs * (cfg.context_len() or 0)
    want = math.ceil(per_token * num_tokens / _GIB)
    cap = int(available_bytes * CPU_KV_MAX_FRACTION) // _GIB
    return CPUKVDefault(
        bytes_per_token=per_token,
        num_tokens=num_tokens,
        available_bytes=available_bytes,
        space_gb=max(1, min(want, cap)),
    )


def build_vllm_command(
    cfg: InferenceConfig, *, python: str, available_bytes: int | None = None
) -> VLLMCommand:
    """The vLLM server command for one resolved inference config (host and port included).
    `available_bytes` (default: this host's, now) caps the default CPU KV cache."""
    if cfg.backend != "vllm":
        raise ValueError(f"build_vllm_command needs backend = 'vllm', got {cfg.backend!r}")
    argv = [python, "-m", "vllm.entrypoints.openai.api_server"]
    for key, value in _flag_values(cfg):
        flag = FLAG_MAP[key]
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value, separators=(",", ":"))]
        else:
            argv += [flag, str(value)]
    argv += ["--enable-prefix-caching" if cfg.enable_prefix_caching else "--no-enable-prefix-caching"]
    # scale-out: /inference/v1/generate; prompt tokens details: cached prompt tokens in `usage`
    argv += ["--enable-scale-out", "--enable-prompt-tokens-details", "--uvicorn-log-level", cfg.log_level]
    argv += ["--logprobs-mode", "processed_logprobs"]  # our contract: temperature applied
    argv += ["--worker-extension-cls", WORKER_EXTENSION_CLS]
    env = {"VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": str(WORKER_EXTENSION_DIR)}
    if cfg.weights.transport == "distributed":
        argv += ["--weight-transfer-config", json.dumps({"backend": WEIGHT_TRANSFER_BACKEND})]
        env |= _weights_env(cfg)
    argv += cfg.vllm.extra_args  # last, so that they win over ours
    if cfg.api_key:  # through the environment, so that it shows in neither `ps` nor --dry-run
        env["VLLM_API_KEY"] = cfg.api_key
    cpu_kv = None
    if cfg.vllm.cpu_kv_cache_space_gb is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.vllm.cpu_kv_cache_space_gb)
    else:
        cpu_kv = cpu_kv_cache_default(cfg, available_bytes or available_memory_bytes())
        if cpu_kv is not None:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(cpu_kv.space_gb)
    extra = dict(cfg.vllm.env)
    if "PYTHONPATH" in extra:  # the user's entries first, the extension's folder kept
        extra["PYTHONPATH"] = f"{extra['PYTHONPATH']}:{WORKER_EXTENSION_DIR}"
    env |= extra
    if "VLLM_CPU_KVCACHE_SPACE" in extra:  # the user's own choice, through [inference.vllm] env
        cpu_kv = None
    return VLLMCommand(argv=argv, env=env, cpu_kv=cpu_kv)


def _weights_env(cfg: InferenceConfig) -> dict[str, str]:
    """What the workers' weight-transfer engine reads: the run's weights endpoint, this server's
    name on it, the transfer deadline, and where the asyncrl package is."""
    w = cfg.weights
    assert w.endpoint is not None, "InferenceConfig requires an endpoint with the distributed transport"
    endpoint = WeightsEndpoint.parse(w.endpoint, cfg.weights_server, timeout_s=w.timeout_s)
    return endpoint.to_env() | {PACKAGE_DIR_ENV: str(Path(asyncrl.__file__).resolve().parent)}


def data_parallel_group_argv(
    argv: list[str], cfg: InferenceConfig, *, address: str, rpc_port: str, start_rank: int
) -> list[str]:
    """`argv` (build_vllm_command's) as the node of a multi-node data-parallel group whose first engine
    is `start_rank`: the head (rank 0) serves HTTP and balances over every engine of the group; the
    others are headless followers (vLLM's `serve --headless`: the api_server module has no such mode)
    that hand their engines to the head at `address`:`rpc_port`. `address` and `rpc_port` may be shell
    expressions."""
    v = cfg.vllm
    group = ["--data-parallel-size-local", str(v.engines_per_node)]
    group += ["--data-parallel-address", address, "--data-parallel-rpc-port", rpc_port]
    if start_rank == 0:
        return [*argv[: -len(v.extra_args) or None], *group, *v.extra_args]
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"], argv[:3]
    head = [argv[0], "-m", "vllm.entrypoints.cli.main", "serve"]
    rest = argv[3 : -len(v.extra_args) or None]
    return [*head, *rest, *group, "--headless", "--data-parallel-start-rank", str(start_rank), *v.extra_args]


def probe_vllm(python: str, *, timeout_s: float = 300.0) -> VLLMProbe:
    """Run the probe script in `python`; ConfigError when vLLM is missing or broken there."""
    try:
        done = subprocess.run(
            [python, "-c", _PROBE, str(WORKER_EXTENSION_DIR)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except FileNotFoundError:
        raise ConfigError(
            f"[inference.vllm] python = {python!r} does not exist; run `bash scripts/setup-vllm.sh` "
            "or point it at an interpreter with vLLM installed"
        ) from None
    except subprocess.TimeoutExpired:
        raise ConfigError(f"probing vLLM with {python} took over {timeout_s:.0f}s") from None
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise ConfigError(f"vLLM is not usable from {python} (run `bash scripts/setup-vllm.sh`):\n{tail}")
    info = json.loads(done.stdout.strip().splitlines()[-1])
    return VLLMProbe(
        version=info["version"],
        device_type=info["device_type"],
        flags=frozenset(info["flags"]),
        architectures=frozenset(info["architectures"]),
    )


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for p in version.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def check_vllm(cfg: InferenceConfig, command: VLLMCommand, probe: VLLMProbe) -> list[str]:
    """Raise ConfigError when this vLLM cannot serve `cfg`; return what to say at start (settings
    without effect, defaults asyncrl chose for this build)."""
    if _version_tuple(probe.version) < MIN_VLLM_VERSION:
        want = ".".join(map(str, MIN_VLLM_VERSION))
        raise ConfigError(
            f"vLLM {probe.version} is too old: asyncrl needs >= {want} (token-in/token-out "
            "/inference/v1/generate, per-token weight versions, pause mode 'keep')"
        )
    unknown = [
        a.split("=")[0] for a in command.argv if a.startswith("--") and a.split("=")[0] not in probe.flags
    ]
    if unknown:
        raise ConfigError(f"vLLM {probe.version} does not accept {sorted(set(unknown))}")
    archs = _model_architectures(cfg.model)
    if not set(archs) & probe.architectures:
        raise ConfigError(f"vLLM {probe.version} cannot serve {cfg.model}: architectures {archs} unsupported")
    if cfg.vllm.enable_return_routed_experts and probe.device_type == "cpu":
        raise ConfigError(
            "[inference.vllm] enable_return_routed_experts needs a GPU build of vLLM; this one is "
            f"'{probe.device_type}'. Turn it off (the trainer then runs without router replay)"
        )
    if cfg.weights.transport == "distributed" and cfg.vllm.data_parallel_size > 1:
        raise ConfigError(
            '[weights] transport = "distributed" takes one vLLM replica per server: set [inference.vllm] '
            "data_parallel_size = 1 and run more servers ([deployment] num_inference_servers)"
        )
    if cfg.fp8.enabled:
        raise ConfigError(
            "[inference.fp8] is the embedded engine's; with vLLM use [inference.vllm] quantization"
        )
    warnings = [
        f"[inference] {k} has no effect with backend = 'vllm'"
        for k in _EMBEDDED_ONLY
        if k in cfg.model_fields_set
    ]
    if not is_loopback(cfg.host):
        warnings.append(
            f"vLLM listens on {cfg.host}: its RL endpoints (/pause, /collective_rpc, /update_weight_version) "
            "are not guarded by its API key; keep its port on a private network"
        )
    if probe.device_type == "cpu" and command.cpu_kv is not None:
        warnings.append(command.cpu_kv.describe())
    return warnings


def _model_architectures(model: str) -> list[str]:
    path = Path(model) / "config.json"
    try:
        archs = json.loads(path.read_text()).get("architectures") or []
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"model {model}: cannot read {path}: {e}") from None
    if not archs:
        raise ConfigError(f"model {model}: config.json names no 'architectures'")
    return list(archs)
