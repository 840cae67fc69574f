"""What `asyncrl rl` checks before it starts any process: every input a child reads at start-up.

    check_inputs(resolved)   # ConfigError naming the key and the path, or None

- the model directory (`model`): config.json of a supported family, safetensors weights, and a
  tokenizer that loads; the servers serve it, the trainer trains it, the orchestrator renders with it;
- every environment of `[[orchestrator.envs.envs]]`, built once with its `args` (its name or factory,
  its arguments and the task files it reads), then closed;
- with `backend = "vllm"`, the interpreter the servers run under (`[inference.vllm] python`).

Without these checks a missing model shows as a server that restarts until its restart budget is
spent and a trainer traceback, and a missing task file as an orchestrator that dies after the
servers are up. `--dry-run` skips them: it starts nothing, and the files may live where the
processes will run.
"""

from __future__ import annotations

import os
from pathlib import Path

from asyncrl.config import ConfigError, EnvsConfig, InferenceConfig
from asyncrl.config.rl import ResolvedRL
from asyncrl.envs import build_env
from asyncrl.envs.chat import ChatTokenizer
from asyncrl.launcher.vllm import resolve_vllm_python
from asyncrl.model import ModelConfigError, load_args

__all__ = ["check_envs", "check_inputs", "check_model_dir", "check_vllm_python"]

_MODEL_DIR = "a Hugging Face model directory: config.json, *.safetensors and tokenizer files"


def check_inputs(resolved: ResolvedRL) -> None:
    """Raise ConfigError for the first input of the run that a process could not read."""
    check_model_dir(resolved.orchestrator.model)
    check_envs(resolved.orchestrator.envs)
    for inference in resolved.inference:
        if inference.backend == "vllm":
            check_vllm_python(inference)


def check_model_dir(path: str, key: str = "model") -> None:
    """`path` holds a model asyncrl can train and serve: config.json, weights and a tokenizer."""
    where = f"{key} = {path!r}"
    if not Path(path).is_dir():
        raise ConfigError(f"{where}: no such directory (expected {_MODEL_DIR})")
    try:
        load_args(path)
    except ModelConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    directory = Path(path)
    index = directory / "model.safetensors.index.json"
    if not index.is_file() and not any(directory.glob("*.safetensors")):
        raise ConfigError(f"{where}: no *.safetensors weights (expected {_MODEL_DIR})")
    try:
        ChatTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where}: its tokenizer does not load ({type(e).__name__}: {e})") from None


def check_envs(config: EnvsConfig) -> None:
    """Build every configured environment once (then close it), as the orchestrator will."""
    for i, env_cfg in enumerate(config.envs):
        where = f"orchestrator.envs.envs[{i}] (name = {env_cfg.name!r})"
        try:
            env = build_env(env_cfg.name, env_cfg.args, seed=config.seed)
        except (OSError, ValueError) as e:  # EnvConfigError and TaskDataError are ValueErrors
            raise ConfigError(f"{where}: {e}") from None
        close = getattr(env, "close", None)
        if callable(close):  # an env holding resources (the swe env's sandbox pool) releases them now
            close()


def check_vllm_python(config: InferenceConfig) -> None:
    """The interpreter vLLM's servers would run under exists and can be executed."""
    python = resolve_vllm_python(config)
    if not (Path(python).is_file() and os.access(python, os.X_OK)):
        raise ConfigError(
            f"[inference.vllm] python = {python!r} is not an executable file; run "
            "`bash scripts/setup-vllm.sh` or point it at an interpreter with vLLM installed"
        )
