"""Weight-update driver: watch `RUN/weights/step_n/STABLE` and move every server to the newest version.

On a new version: `update_weights {path, version}` on every healthy server at once. Each server
pauses itself only as long as it must, in keep mode (running requests hold their KV cache): the
embedded server reads and checks the checkpoint while it keeps generating and stops only for the
swap between two engine steps; VLLMBackend pauses vLLM around its reload. The stall each server
reports (`paused_seconds`) and its read time (`load_seconds`) are logged apart.

A server that fails the update is paused (keep) and leaves the rotation: it would otherwise
sample with stale weights under a new version. It stays paused until it rejoins: the pool's
health probe calls `sync_server`, which loads the current version and resumes it.

Servers get the resolved path of `weights/step_n`: one publication's own directory. A version
published again (a trainer rerun from an older checkpoint outside `asyncrl rl --resume`, which
retracts such versions before anything starts) is a new directory behind the same link, and is
loaded on every server like a new version.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path

from asyncrl.envs.backend import InferenceError
from asyncrl.orchestrator.pool import Server, ServerPool
from asyncrl.transport.weights import latest_stable_step, weights_dir
from asyncrl.wire import PauseRequest, UpdateWeightsRequest

__all__ = ["WeightUpdater"]

log = logging.getLogger(__name__)


class WeightUpdater:
    def __init__(
        self,
        pool: ServerPool,
        run_dir: str | Path,
        *,
        poll_s: float = 0.05,
        on_version: Callable[[int], None] | None = None,
    ) -> None:
        self.pool, self.run_dir, self.poll_s = pool, Path(run_dir), poll_s
        self.version = 0
        self.path: str | None = None  # the publication of `version` the servers were sent
        self.on_version = on_version
        self.pause_seconds: list[float] = []  # per update: the longest generation stall of a server
        self.load_seconds: list[float] = []  # per update: the longest checkpoint read of a server

    async def sync_once(self) -> bool:
        """Load the newest STABLE weights if newer than what the servers hold, or the version they
        hold published again; True if updated."""
        latest = latest_stable_step(self.run_dir)
        if latest is None or latest < self.version:
            return False
        if latest == self.version and self._request(latest).path == self.path:
            return False
        await self.update(latest)
        return True

    async def update(self, version: int) -> None:
        request = self._request(version)
        t0 = time.monotonic()
        results = await self.pool.call_all(lambda b: b.update_weights(request))
        for server in self.pool.servers:
            if isinstance(results.get(server.url), Exception):
                # hold its requests (keep) until it rejoins with the current weights; best effort,
                # since a server that cannot answer is out of the rotation all the same
                with contextlib.suppress(InferenceError):
                    await server.backend.pause(PauseRequest(mode="keep"))
        self._fail(results, "update")
        done = [r for r in results.values() if not isinstance(r, Exception)]
        paused = max((r.paused_seconds for r in done), default=0.0)
        loaded = max((r.load_seconds for r in done), default=0.0)
        self.pause_seconds.append(paused)
        self.load_seconds.append(loaded)
        self.version, self.path = version, request.path
        log.info(
            "weights v%d (%s) loaded on %d server(s) in %.3fs (read %.3fs, generation paused %.3fs)",
            version,
            request.path,
            len(self.pool.healthy_servers),
            time.monotonic() - t0,
            loaded,
            paused,
        )
        if self.on_version is not None:
            self.on_version(version)

    async def sync_server(self, server: Server) -> bool:
        """Rejoin = bring the server to the current version, then resume it; False if it can't.

        The resume is unconditional: a server whose update failed was left paused by `update`, and
        a restarted one may have been paused by an earlier orchestrator.
        """
        try:
            held = (await server.backend.weights()).version
            if held < self.version:
                await server.backend.update_weights(self._request(self.version))
                log.info(
                    "server %s brought from v%d to v%d before re-admission", server.url, held, self.version
                )
            await server.backend.resume()
        except InferenceError as e:
            log.warning("server %s: weight sync before re-admission failed: %s", server.url, e)
            return False
        return True

    def _request(self, version: int) -> UpdateWeightsRequest:
        return UpdateWeightsRequest(path=str(weights_dir(self.run_dir, version).resolve()), version=version)

    def _fail(self, results: dict, what: str) -> None:
        for server in self.pool.servers:
            err = results.get(server.url)
            if isinstance(err, Exception):
                self.pool.mark_down(server, f"{what} failed: {type(err).__name__}: {err}")

    async def run(self) -> None:
        """Forever: poll for new versions."""
        while True:
            await self.sync_once()
            await asyncio.sleep(self.poll_s)
