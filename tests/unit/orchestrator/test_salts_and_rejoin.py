"""Against the fake servers, step by step: per-token versions across an update, the salt of later
turns and retries, and a server that failed an update serving again after it rejoins, also when
its rejoin and an update overlap (in-process backends)."""

from __future__ import annotations

import asyncio

from asyncrl.client import build_backends
from asyncrl.config.envs import EnvConfig
from asyncrl.config.orchestrator import OrchestratorConfig
from asyncrl.envs import Environment, Reward, Rubric, Task
from asyncrl.envs.chat import ChatTokenizer
from asyncrl.orchestrator.dispatcher import Dispatcher
from asyncrl.orchestrator.pool import ServerPool
from asyncrl.orchestrator.weights import WeightUpdater
from asyncrl.transport.weights import stage_weights
from asyncrl.wire import (
    PauseRequest,
    PauseResponse,
    ResumeResponse,
    SamplingParams,
    UpdateWeightsRequest,
    UpdateWeightsResponse,
    WeightsInfo,
)

from .fake_server import FakeServer


class TwoTurnEnv(Environment):
    """Replies once, after `gate` opens (the test lands a weight update in between)."""

    name = "two-turn"
    max_turns = 2

    def __init__(self) -> None:
        super().__init__(seed=0)
        self.rubric = Rubric(rewards=(Reward(name="one", fn=lambda state: 1.0),))
        self.between_turns, self.gate = asyncio.Event(), asyncio.Event()

    def task(self, split, index):
        return Task(id=f"two/{index}", prompt=[{"role": "user", "content": "go"}])

    def reference(self, task):
        return []

    async def respond(self, state, text):
        if state.num_turns >= 2:
            return None
        self.between_turns.set()
        await self.gate.wait()
        return [{"role": "user", "content": "again"}]


def _dispatcher(tmp_path, tokenizer_dir, servers: list[FakeServer]) -> Dispatcher:
    cfg = OrchestratorConfig(
        run_dir=str(tmp_path / "run"),
        model=str(tokenizer_dir),
        servers=[s.url for s in servers],
        batch_size=4,
        group_size=4,
        max_episode_retries=2,
        sampling=SamplingParams(max_tokens=8),
    )
    pool = ServerPool(build_backends(cfg.servers))
    return Dispatcher(cfg, pool, None, ChatTokenizer.from_pretrained(tokenizer_dir))


def _publish(tmp_path, version: int) -> None:
    with stage_weights(tmp_path / "run", version) as tmp:
        (tmp / "config.json").write_text("{}")


async def _wait_until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.01)


def test_an_update_mid_response_keeps_per_token_versions_and_moves_the_salt(tmp_path, tokenizer_dir, servers):
    (server,) = servers(1, hold_after_tokens=1)
    dispatcher = _dispatcher(tmp_path, tokenizer_dir, [server])
    updater = WeightUpdater(dispatcher.pool, tmp_path / "run", on_version=dispatcher.on_version)
    env = TwoTurnEnv()

    async def go():
        episode = asyncio.create_task(
            dispatcher._run_episode(EnvConfig(name="two-turn"), env, env.task("train", 0), 0, "e0")
        )
        await _wait_until(lambda: server.seen and server.seen[0].policy_versions)  # one v0 token, held
        _publish(tmp_path, 1)
        update = asyncio.create_task(updater.sync_once())  # pause (keep), load v1, resume
        await _wait_until(lambda: server.version == 1)
        server.release()
        await update
        await env.between_turns.wait()
        env.gate.set()
        try:
            return await episode
        finally:
            await dispatcher.pool.aclose()

    episode = asyncio.run(asyncio.wait_for(go(), timeout=30))
    first, second = server.seen
    assert first.policy_versions[0] == 0 and set(first.policy_versions[1:]) == {1}
    (sample,) = episode.samples
    sampled = sample.policy_versions[sample.loss_mask].tolist()
    assert sampled == first.policy_versions + second.policy_versions  # not collapsed to one per turn
    # Turn 1 went out at v0; turn 2 after the update names v1, and reuses no KV of v0.
    assert [s.cache_salt for s in server.seen] == ["0", "1"]
    assert second.num_cached_tokens == 0


def test_later_turns_share_the_prefix_cache_and_a_retry_names_the_current_version(
    tmp_path, tokenizer_dir, servers
):
    a, b = servers(2)
    a.hang_after = 0  # a's first request never answers; its connection is then cut
    dispatcher = _dispatcher(tmp_path, tokenizer_dir, [a, b])
    dispatcher.pool.servers[1].healthy = False  # the episode starts on `a`
    env = TwoTurnEnv()
    env.gate.set()

    async def go():
        episode = asyncio.create_task(
            dispatcher._run_episode(EnvConfig(name="two-turn"), env, env.task("train", 0), 0, "e0")
        )
        await _wait_until(lambda: a.num_requests == 1)
        b.version = 3
        dispatcher.on_version(3)  # the servers moved on while the request hung
        dispatcher.pool.servers[1].healthy = True
        await asyncio.to_thread(a.stop)  # ServerUnavailable: the episode is retried on b
        try:
            return await episode
        finally:
            await dispatcher.pool.aclose()

    episode = asyncio.run(asyncio.wait_for(go(), timeout=30))
    assert not episode.failed and dispatcher.counters.episodes_retried == 1
    assert [s.cache_salt for s in b.seen] == ["3", "3"]  # the retry, then its second turn
    assert b.seen[1].num_cached_tokens > 0  # the second turn reuses the first turn's KV


def test_a_server_that_failed_an_update_serves_again_after_it_rejoins(tmp_path, tokenizer_dir, servers):
    a, b = servers(1), servers(1, fail_updates=1)
    (a,), (b,) = a, b
    pool = ServerPool(build_backends([a.url, b.url]))
    updater = WeightUpdater(pool, tmp_path)
    with stage_weights(tmp_path, 1) as tmp:
        (tmp / "config.json").write_text("{}")

    async def go():
        await updater.sync_once()
        assert [s.url for s in pool.healthy_servers] == [a.url] and b.paused and b.version == 0
        probe = asyncio.create_task(pool.health_loop(0.05, updater.sync_server))
        await _wait_until(lambda: len(pool.healthy_servers) == 2)
        probe.cancel()
        sessions = [pool.session(f"e{i}") for i in range(2)]  # least-loaded: one on each server
        try:
            return await asyncio.gather(
                *(s.generate([1, 2, 3], SamplingParams(max_tokens=4)) for s in sessions)
            )
        finally:
            await pool.aclose()

    outs = asyncio.run(asyncio.wait_for(go(), timeout=20))
    assert not b.paused and b.version == 1 and a.num_requests == b.num_requests == 1
    assert all(set(out.policy_versions) == {1} for out in outs)


class GatedBackend:
    """An in-process server whose weight loads wait on `gate` when it is set to an Event."""

    def __init__(self, url: str, version: int = 0) -> None:
        self.url, self.version, self.paused = url, version, False
        self.gate: asyncio.Event | None = None
        self.loading = asyncio.Event()  # set while a load waits on the gate

    async def update_weights(self, request: UpdateWeightsRequest) -> UpdateWeightsResponse:
        if self.gate is not None:
            self.loading.set()
            await self.gate.wait()
        self.version = request.version
        return UpdateWeightsResponse(version=request.version, load_seconds=0.0, paused_seconds=0.0)

    async def weights(self) -> WeightsInfo:
        return WeightsInfo(version=self.version)

    async def pause(self, request: PauseRequest) -> PauseResponse:
        self.paused = True
        return PauseResponse(paused=True, mode=request.mode, num_aborted=0)

    async def resume(self) -> ResumeResponse:
        self.paused = False
        return ResumeResponse(paused=False)

    async def health(self, timeout_s: float) -> bool:
        return True

    async def aclose(self) -> None:
        pass


def _rejoin_race(tmp_path, slow: str) -> tuple[GatedBackend, bool, WeightUpdater]:
    """A server at v1 rejoins while the others move from v1 to v2; `slow` names whose load waits."""
    for v in (1, 2):
        _publish(tmp_path, v)
    up, back = GatedBackend("mem://up", version=1), GatedBackend("mem://back", version=1)
    pool = ServerPool([up, back])
    pool.servers[1].healthy, back.paused = False, True  # it failed an earlier update
    updater = WeightUpdater(pool, tmp_path / "run")
    updater.version = updater.target = 1
    gated = {"update": up, "rejoin": back}[slow]
    gated.gate = asyncio.Event()

    async def go() -> bool:
        if slow == "update":  # the rejoin starts while v2 is being loaded on the healthy server
            update = asyncio.create_task(updater.sync_once())
            await gated.loading.wait()
            rejoined = await updater.sync_server(pool.servers[1])
            gated.gate.set()
            await update
        else:  # v2 is published and rolled out while the rejoining server loads v1
            rejoin = asyncio.create_task(updater.sync_server(pool.servers[1]))
            back.version = 0  # restarted: it held the base model
            await gated.loading.wait()
            await updater.sync_once()
            gated.gate.set()
            rejoined = await rejoin
        return rejoined

    return back, asyncio.run(asyncio.wait_for(go(), timeout=10)), updater


def test_a_server_rejoining_during_an_update_is_brought_to_that_update_s_version(tmp_path):
    back, rejoined, updater = _rejoin_race(tmp_path, slow="update")
    assert rejoined and updater.version == 2
    assert back.version == 2 and not back.paused  # not v1, the version before the update


def test_an_update_during_a_rejoin_is_loaded_before_the_server_is_readmitted(tmp_path):
    back, rejoined, updater = _rejoin_race(tmp_path, slow="rejoin")
    assert rejoined and updater.version == 2
    assert back.version == 2 and not back.paused  # the update did not ask it: the rejoin loaded v2
