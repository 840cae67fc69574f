"""`asyncrl orchestrator @ cfg.toml [--dotted.key value]`: rollouts -> RUN/rollouts/step_n/.

Talks to the inference servers over HTTP only, watches RUN/weights/ for new policy versions and
drives the weight updates, and writes one batch per trainer step.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

from asyncrl.config import ConfigError, load_config
from asyncrl.config.orchestrator import OrchestratorConfig
from asyncrl.envs import EnvMixture
from asyncrl.envs.chat import ChatTokenizer
from asyncrl.orchestrator.dispatcher import Dispatcher
from asyncrl.orchestrator.metrics import format_line
from asyncrl.orchestrator.pool import ServerPool
from asyncrl.orchestrator.weights import WeightUpdater
from asyncrl.transport.metrics import MetricsWriter

log = logging.getLogger("asyncrl.orchestrator")


async def run_orchestrator(cfg: OrchestratorConfig) -> None:
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    pool = ServerPool.from_urls(
        cfg.servers, api_key=cfg.api_key, timeout_s=cfg.request_timeout_s, kind=cfg.inference_backend
    )
    try:
        await pool.wait_ready(cfg.server_ready_timeout_s)
        dispatcher = Dispatcher(
            cfg, pool, EnvMixture.from_config(cfg.envs), ChatTokenizer.from_pretrained(cfg.model)
        )
        updater = WeightUpdater(pool, run_dir, poll_s=cfg.weights_poll_s, on_version=dispatcher.on_version)
        await updater.sync_once()  # resume: servers start from the newest published weights
        background = [
            asyncio.create_task(updater.run()),
            asyncio.create_task(pool.health_loop(cfg.health_poll_s, updater.sync_server)),
        ]

        writer = MetricsWriter(run_dir, "orchestrator")

        def on_batch(step: int, metrics: dict) -> None:
            metrics["inference/pause_s"] = sum(updater.pause_seconds)
            updater.pause_seconds.clear()
            print(format_line(writer.write(step, metrics)), flush=True)

        try:
            await dispatcher.run(on_batch)
        finally:
            for t in background:
                t.cancel()
            await asyncio.gather(*background, return_exceptions=True)
    finally:
        await pool.aclose()


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
    asyncio.run(run_orchestrator(cfg))
    return 0
