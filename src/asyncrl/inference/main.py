"""`asyncrl inference --model DIR [--port 8000] [--dtype float32|bfloat16] [--max-num-seqs N]
[--api-key KEY]`.

Also `asyncrl inference @ inference.toml --port 8001`: every InferenceConfig field can come from
TOML files and `--dotted.key value` overrides. Serves the API of docs/architecture.md on host:port.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import uvicorn
from fastapi import FastAPI
from transformers import AutoTokenizer

from asyncrl.config import ConfigError, load_config
from asyncrl.config.inference import InferenceConfig
from asyncrl.inference.async_engine import AsyncEngine
from asyncrl.inference.engine import Engine
from asyncrl.inference.server import build_app
from asyncrl.model import ModelConfigError, Transformer, cpu_norm
from asyncrl.model.compute import cpu_kernels, packing_note
from asyncrl.model.mtp import PREFIX as MTP_PREFIX
from asyncrl.model.serving import serving_format

if TYPE_CHECKING:
    from asyncrl.weight_transfer import ReceiveLoop

__all__ = ["build_receiver", "build_server_app", "main"]

log = logging.getLogger("asyncrl.inference")


def build_server_app(config: InferenceConfig) -> FastAPI:
    """Load the model and tokenizer from `config.model` and wire up the FastAPI app (not started)."""
    if not Path(config.model).is_dir():
        raise ModelConfigError(f"model directory not found: {config.model}")
    tokenizer = AutoTokenizer.from_pretrained(config.model)

    def detokenize(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    driver = AsyncEngine.load(config, detokenize=detokenize)
    name = config.served_model_name or Path(config.model).resolve().name
    return build_app(driver, tokenizer, config, name, build_receiver(config, driver.engine))


def build_receiver(config: InferenceConfig, engine: Engine) -> ReceiveLoop | None:
    """With `weights.transport = "distributed"`: the thread that takes versions from the trainer, in
    the serving format the trainer sends (the engine's dtype, FP8 blocks when it serves FP8)."""
    w = config.weights
    if w.transport != "distributed":
        return None
    assert w.endpoint is not None, "InferenceConfig requires an endpoint with transport = distributed"
    # here, not at the top: the transfer machinery (DTensor) costs a server that never uses it ~1 s
    from asyncrl.weight_transfer import ReceiveLoop, WeightsEndpoint, published_shapes

    endpoint = WeightsEndpoint.parse(w.endpoint, config.weights_server, timeout_s=w.timeout_s)
    args = engine.model.args
    with torch.device("meta"):
        plain = Transformer(args)  # the trainer's module tree: the engine's may hold FP8 modules
    fmt = serving_format(plain, engine.dtype, fp8=config.fp8.enabled, ignore=config.fp8.ignore)
    shapes = published_shapes(plain, fmt)
    # checkpoint MTP layers live only in a loaded model; they travel verbatim
    shapes |= {n: tuple(t.shape) for n, t in engine.model.state_dict().items() if n.startswith(MTP_PREFIX)}
    log.info("weights: receiving versions from %s as '%s'", endpoint.address, endpoint.server)
    return ReceiveLoop(endpoint, expected_shapes=shapes, device=engine.device)


def _kernels_note(engine: Engine) -> str:
    """On a CPU: how it runs the engine's bf16/fp16 ops (decided at start) and which weights are
    packed; empty elsewhere."""
    if engine.device.type != "cpu":
        return ""
    notes = (engine.decode_attention_note, engine.matmul_kernel_note, cpu_norm.note())
    kernels = "".join(f"; {note}" for note in notes if note)
    if engine.dtype == torch.float32:
        return f"; {packing_note()}{kernels}"
    return f"; {cpu_kernels().describe()}{kernels}"


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
    driver = app.state.server.engine
    engine = driver.engine
    log.info(
        "serving %s on http://%s:%d (%s, %s, %d torch thread(s), KV pool %d blocks x %d tokens, %.1f MiB%s)",
        app.state.server.model_name,
        config.host,
        config.port,
        config.dtype,
        engine.device,
        driver.torch_threads,
        engine.pool.num_blocks,
        config.block_size,
        engine.cache.nbytes() / 2**20,
        _kernels_note(engine),
    )
    torch.set_num_threads(1)  # this thread serves HTTP: its torch ops make no pool beside the engine's
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level)
    return 0
