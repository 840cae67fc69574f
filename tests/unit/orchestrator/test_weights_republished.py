"""A version published again (a new directory behind weights/step_n) is loaded again on every server."""

from __future__ import annotations

import asyncio
import logging

from asyncrl.orchestrator.pool import ServerPool
from asyncrl.orchestrator.weights import WeightUpdater
from asyncrl.run_dir import weights_dir
from asyncrl.transport.weights import stage_weights
from asyncrl.wire import WeightsInfo

from .test_pool_backends import MemoryBackend


def _publish(run_dir, step: int) -> str:
    with stage_weights(run_dir, step) as tmp:
        (tmp / "config.json").write_text("{}")
    return str(weights_dir(run_dir, step).resolve())


def test_a_republished_version_is_reloaded_and_the_log_names_the_publication(tmp_path, caplog):
    a, b = MemoryBackend("mem://a"), MemoryBackend("mem://b")
    seen: list[int] = []
    updater = WeightUpdater(ServerPool([a, b]), tmp_path, on_version=seen.append)
    caplog.set_level(logging.INFO, logger="asyncrl.orchestrator.weights")

    first = _publish(tmp_path, 2)
    assert asyncio.run(updater.sync_once()) is True
    assert asyncio.run(updater.sync_once()) is False  # nothing new
    again = _publish(tmp_path, 2)  # step 2 retrained from an older checkpoint
    assert again != first
    assert asyncio.run(updater.sync_once()) is True
    assert asyncio.run(updater.sync_once()) is False
    assert a.calls == b.calls == ["update:2", "update:2"] and seen == [2, 2]
    assert updater.path == again
    loads = [r.getMessage() for r in caplog.records if "loaded on" in r.getMessage()]
    assert [f"({first})" in loads[0], f"({again})" in loads[1]] == [True, True]


class _PathBackend(MemoryBackend):
    """Reports the publication it loaded, as the embedded server does."""

    path: str | None = None

    async def update_weights(self, request):
        self.path = request.path
        return await super().update_weights(request)

    async def weights(self):
        return WeightsInfo(version=self.version, path=self.path)


def test_a_rejoining_server_holding_an_older_publication_of_the_version_reloads_it(tmp_path):
    a, b = _PathBackend("mem://a"), _PathBackend("mem://b")
    updater = WeightUpdater(ServerPool([a, b]), tmp_path)
    _publish(tmp_path, 2)
    asyncio.run(updater.sync_once())
    again = _publish(tmp_path, 2)  # published again while b is out of rotation
    pool_b = updater.pool.servers[1]
    updater.pool.mark_down(pool_b, "test")
    asyncio.run(updater.sync_once())  # a only
    assert asyncio.run(updater.sync_server(pool_b)) is True
    assert a.path == b.path == again and b.calls[-2:] == ["update:2", "resume"]
