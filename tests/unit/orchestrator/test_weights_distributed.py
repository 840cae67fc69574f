"""With the distributed transport the weight updater asks servers to swap in what they received, and a
server that did not receive the version is treated as a failed file load: paused (keep), out of
rotation, and brought to the target by `sync_server` once it has it."""

from __future__ import annotations

import asyncio

from asyncrl.client import ServerUnavailable
from asyncrl.orchestrator.pool import ServerPool
from asyncrl.orchestrator.weights import WeightUpdater
from asyncrl.transport.weights import stage_weights
from asyncrl.wire import UpdateWeightsResponse

from .test_pool_backends import MemoryBackend


class _Receiving(MemoryBackend):
    """Holds the versions the trainer sent it (`received`); updates to one it lacks fail with a 503."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.received, self.transports = 0, []

    async def update_weights(self, request):
        self.transports.append(request.transport)
        if self.received < request.version:
            self.calls.append(f"missing:{request.version}")
            raise ServerUnavailable(f"{self.url}: did not receive version >= {request.version}")
        self.calls.append(f"update:{self.received}")
        self.version = self.received
        return UpdateWeightsResponse(version=self.received, load_seconds=0.0, paused_seconds=0.0)


def _publish(run_dir, step: int) -> None:
    with stage_weights(run_dir, step) as tmp:
        (tmp / "manifest.json").write_text("{}")


def test_a_server_that_missed_a_version_is_paused_out_of_rotation_and_synced_once_it_has_it(tmp_path):
    a, b = _Receiving("mem://a"), _Receiving("mem://b")
    pool = ServerPool([a, b])
    updater = WeightUpdater(pool, tmp_path, transport="distributed")
    a.received = 1  # b's channel broke during v1
    _publish(tmp_path, 1)
    assert asyncio.run(updater.sync_once()) is True
    assert a.transports == b.transports == ["distributed"]
    assert (a.version, b.version) == (1, 0)
    assert [s.url for s in pool.healthy_servers] == ["mem://a"]
    assert b.calls == ["missing:1", "pause:keep"]
    assert asyncio.run(updater.sync_server(pool.servers[1])) is False  # still without v1: stays out
    b.received = 1  # it joined anew and the trainer sent it the current version
    assert asyncio.run(updater.sync_server(pool.servers[1])) is True
    assert b.version == 1 and b.calls[-2:] == ["update:1", "resume"]
