"""Weight-update driver: watch `RUN/weights/step_n/STABLE` and move every server to the newest version.

On a new version: `update_weights {path, version}` on every healthy server at once. Each server
pauses itself only as long as it must, in keep mode (running requests hold their KV cache): the
embedded server reads and checks the checkpoint while it keeps generating and stops only for the
swap between two engine steps; VLLMBackend pauses vLLM around its reload. The stall each server
reports (`paused_seconds`) and its read time (`load_seconds`) are logged apart.

A server that fails the update is paused (keep) and leaves the rotation: it would otherwise
sample with stale weights under a new version. It stays paused until it rejoins: the pool's
health probe calls `sync_server`, which loads the newest version being rolled out (`target`, set
before any server is asked, so a server rejoining during an update is brought to that update's
version, not the one before) and resumes it.

With `[weights] transport = "distributed"` the trainer has sent each version to every server
before it publishes it, and the request says so (`transport`): a server swaps in the version it
received (waiting a bounded time for it) instead of reading files; the rest is as above, and a
server that missed a version gets it from the trainer when it joins anew, before `sync_server`
resumes it.

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
from typing import Literal

from asyncrl.client import InferenceError
from asyncrl.orchestrator.pool import Server, ServerPool
from asyncrl.run_dir import weights_dir
from asyncrl.transport.weights import latest_stable_step
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
        transport: Literal["filesystem", "distributed"] = "filesystem",
    ) -> None:
        self.pool, self.run_dir, self.poll_s = pool, Path(run_dir), poll_s
        self.transport = transport
        self.version = 0  # every healthy server answered for it
        self.target = 0  # the newest version being rolled out; >= version
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
        self.target = max(self.target, version)
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
        """Rejoin = bring the server to `target`, then resume it; False if it can't.

        The resume is unconditional: a server whose update failed was left paused by `update`, and
        a restarted one may have been paused by an earlier orchestrator. An update that starts
        while this runs does not ask this server (it is out of rotation), so the sync repeats until
        it ends on the newest target; the caller re-admits the server with no await in between
        (as `ServerPool.health_loop` does), so no update can start unseen in that gap.
        """
        try:
            while True:
                target, info = self.target, await server.backend.weights()
                held, request = info.version, self._request(target)
                # same number, other publication (a version published again): reload it too; a
                # backend that cannot tell its path (vLLM) is trusted on the number
                if held < target or (held == target and info.path not in (None, request.path)):
                    await server.backend.update_weights(request)
                    log.info(
                        "server %s brought from v%d to v%d before re-admission", server.url, held, target
                    )
                await server.backend.resume()
                if self.target == target:
                    return True
        except InferenceError as e:
            log.warning("server %s: weight sync before re-admission failed: %s", server.url, e)
            return False

    def _request(self, version: int) -> UpdateWeightsRequest:
        path = str(weights_dir(self.run_dir, version).resolve())
        return UpdateWeightsRequest(path=path, version=version, transport=self.transport)

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
