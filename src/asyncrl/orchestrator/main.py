"""`asyncrl orchestrator @ cfg.toml [--dotted.key value]`: rollouts -> RUN/rollouts/step_n/.

Talks to the inference servers over HTTP only, watches RUN/weights/ for new policy versions and
drives the weight updates, and writes one batch per trainer step. With `[eval] interval` set it
also evaluates every N policy versions (asyncrl.orchestrator.evaluator) and, after its last batch,
waits for the trainer's final version to evaluate it. With `--resume true` it continues from the
checkpoint stored with the newest batch (see asyncrl.orchestrator.checkpoint).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

from asyncrl.client import build_backends
from asyncrl.config import ConfigError, load_config
from asyncrl.config.orchestrator import OrchestratorConfig
from asyncrl.envs import EnvMixture
from asyncrl.envs.chat import ChatTokenizer
from asyncrl.orchestrator.checkpoint import OrchestratorState, load_latest_state
from asyncrl.orchestrator.dispatcher import Dispatcher
from asyncrl.orchestrator.evaluator import Evaluator
from asyncrl.orchestrator.fill import FillStalledError
from asyncrl.orchestrator.metrics import format_line
from asyncrl.orchestrator.pool import ServerPool
from asyncrl.orchestrator.weights import WeightUpdater
from asyncrl.run_dir import batch_dir, rollouts_root
from asyncrl.transport.metrics import MetricsWriter

log = logging.getLogger("asyncrl.orchestrator")


async def run_orchestrator(cfg: OrchestratorConfig) -> None:
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    state = _resume_state(cfg)
    backends = build_backends(
        cfg.servers,
        kind=cfg.inference_backend,
        api_key=cfg.api_key,
        timeout_s=cfg.request_timeout_s,
        prefill_urls=cfg.prefill_servers,
    )
    gateway = None
    if cfg.router_url is not None:
        kw = {"kind": cfg.inference_backend, "api_key": cfg.api_key, "timeout_s": cfg.request_timeout_s}
        (gateway,) = build_backends([cfg.router_url], **kw)
    pool = ServerPool.from_config(cfg, backends, gateway)
    evaluator: Evaluator | None = None
    try:
        await pool.wait_ready(cfg.server_ready_timeout_s)
        await pool.poll_loads()  # the servers' block size before the first request is hashed
        mixture = EnvMixture.from_config(cfg.envs)
        tokenizer = ChatTokenizer.from_pretrained(cfg.model)
        dispatcher = Dispatcher(cfg, pool, mixture, tokenizer)
        writer = MetricsWriter(run_dir, "orchestrator")
        if state is not None:
            dispatcher.restore(state)
            writer.write_missing(state.step, state.metrics)  # a crash after batch B, before its line
        if cfg.eval.enabled:
            evaluator = Evaluator(cfg, pool, tokenizer, mixture, on_line=lambda line: print(line, flush=True))

        def on_version(version: int) -> None:
            dispatcher.on_version(version)
            if evaluator is not None:
                evaluator.on_version(version)

        updater = WeightUpdater(
            pool, run_dir, poll_s=cfg.weights_poll_s, on_version=on_version, transport=cfg.weights_transport
        )
        if evaluator is not None:
            await evaluator.resume(updater)  # an eval a crash cut short, at its own version
        await updater.sync_once()  # resume: servers start from the newest published weights
        if evaluator is not None:
            evaluator.on_version(updater.version)  # v0 is due first
        background = [
            asyncio.create_task(updater.run()),
            asyncio.create_task(pool.health_loop(cfg.health_poll_s, updater.sync_server)),
            asyncio.create_task(pool.load_loop(cfg.metrics_poll_s)),
        ]

        def on_batch(step: int, metrics: dict) -> None:
            metrics["inference/pause_s"] = sum(updater.pause_seconds)
            metrics["inference/weight_load_s"] = sum(updater.load_seconds)
            updater.pause_seconds.clear()
            updater.load_seconds.clear()
            print(format_line(writer.write(step, metrics)), flush=True)

        try:
            await dispatcher.run(on_batch, lambda line: print(f"[orchestrator] {line}", flush=True))
            if evaluator is not None:
                await evaluator.finish()  # up to the final version, which the trainer publishes last
        finally:
            for t in background:
                t.cancel()
            await asyncio.gather(*background, return_exceptions=True)
    finally:
        if evaluator is not None:
            await evaluator.aclose()
        await pool.aclose()


def _resume_state(cfg: OrchestratorConfig) -> OrchestratorState | None:
    """The checkpoint to continue from (resume), or None; refuses to write over existing batches."""
    if not cfg.resume:
        first = batch_dir(cfg.run_dir, cfg.start_step)
        if first.exists():
            raise ValueError(
                f"{first} already exists: continue this run with resume = true (asyncrl rl ... --resume), "
                "or start a new run in another run_dir"
            )
        return None
    state = load_latest_state(cfg.run_dir)
    if state is None:
        log.info("resume: no batch in %s yet, starting from batch 1", rollouts_root(cfg.run_dir))
    else:
        log.info(
            "resume after batch %d: %d group(s) buffered, %d in flight re-dispatched, next task index %d",
            state.step,
            len(state.buffered),
            len(state.in_flight),
            state.next_index,
        )
    return state


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        print("Keys (OrchestratorConfig):", ", ".join(OrchestratorConfig.model_fields))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = load_config(OrchestratorConfig, argv)
    except ConfigError as e:
        print(f"asyncrl orchestrator: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(run_orchestrator(cfg))
    except FillStalledError as e:
        print(f"asyncrl orchestrator: {e}", file=sys.stderr, flush=True)
        return 1
    return 0
