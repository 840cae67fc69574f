"""`asyncrl inference --model DIR [--port 8000] [--dtype float32|bfloat16] [--max-num-seqs N]
[--api-key KEY]`.

Also `asyncrl inference @ inference.toml --port 8001`: every InferenceConfig field can come from
TOML files and `--dotted.key value` overrides. Serves the API of docs/architecture.md on host:port.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import uvicorn
from fastapi import FastAPI
from transformers import AutoTokenizer

from asyncrl.config import ConfigError, load_config
from asyncrl.config.inference import InferenceConfig
from asyncrl.inference.async_engine import AsyncEngine
from asyncrl.inference.engine import Engine
from asyncrl.inference.server import build_app
from asyncrl.model import ModelConfigError
from asyncrl.model.compute import cpu_kernels

__all__ = ["build_server_app", "main"]

log = logging.getLogger("asyncrl.inference")


def build_server_app(config: InferenceConfig) -> FastAPI:
    """Load the model and tokenizer from `config.model` and wire up the FastAPI app (not started)."""
    if not Path(config.model).is_dir():
        raise ModelConfigError(f"model directory not found: {config.model}")
    tokenizer = AutoTokenizer.from_pretrained(config.model)

    def detokenize(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    engine = Engine.from_config(config, detokenize=detokenize)
    name = config.served_model_name or Path(config.model).resolve().name
    return build_app(AsyncEngine(engine), tokenizer, config, name)


def _kernels_note(engine: Engine) -> str:
    """How this CPU runs the engine's bf16/fp16 ops (decided at start); empty otherwise."""
    if engine.device.type != "cpu" or engine.dtype == torch.float32:
        return ""
    return f"; {cpu_kernels().describe()}"


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        print("fields:", ", ".join(f"--{k.replace('_', '-')}" for k in InferenceConfig.model_fields))
        return 0
    config = load_config(InferenceConfig, argv)
    if config.backend != "embedded":
        raise ConfigError(
            f"this command serves the embedded engine only; backend = {config.backend!r} is served by "
            "vLLM itself: `asyncrl rl ... --dry-run` prints each server's command (docs/inference.md)"
        )
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        app = build_server_app(config)
    except (ModelConfigError, OSError) as e:  # a missing or malformed model directory
        raise SystemExit(f"asyncrl inference: cannot load model '{config.model}': {e}") from None
    engine = app.state.server.engine.engine
    log.info(
        "serving %s on http://%s:%d (%s, %s, KV pool %d blocks x %d tokens, %.1f MiB%s)",
        app.state.server.model_name,
        config.host,
        config.port,
        config.dtype,
        engine.device,
        engine.pool.num_blocks,
        config.block_size,
        engine.cache.nbytes() / 2**20,
        _kernels_note(engine),
    )
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level)
    return 0
