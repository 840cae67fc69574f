"""Routing in the pool: cache-aware placement by prefix blocks, salts, the imbalance bound, the other
modes, and an external router by URL. In-process backends with a prefix cache stand in for servers."""

from __future__ import annotations

import asyncio
import json

import httpx

from asyncrl.client import VLLMBackend
from asyncrl.config.orchestrator import OrchestratorConfig
from asyncrl.orchestrator.load import ServerLoad
from asyncrl.orchestrator.pool import ServerPool
from asyncrl.orchestrator.routing import PrefixIndex, Router, prefix_hashes
from asyncrl.wire import (
    GenerateRequest,
    GenerateResponse,
    PauseRequest,
    PauseResponse,
    ResumeResponse,
    SamplingParams,
    UpdateWeightsRequest,
    UpdateWeightsResponse,
    WeightsInfo,
)

BLOCK = 4
SYSTEM_A = list(range(100, 124))  # 6 blocks of a shared system prompt
SYSTEM_B = list(range(200, 224))


def embedded_metrics(*, running: int = 0, used: int = 0, free: int = 64, block_size: int = BLOCK) -> str:
    """The gauges the pool reads, as the embedded server writes them."""
    return (
        f"asyncrl_requests_running {running}\nasyncrl_requests_waiting 0\n"
        f"asyncrl_kv_blocks_used {used}\nasyncrl_kv_blocks_free {free}\n"
        f"asyncrl_kv_cache_tokens {(used + free) * block_size}\n"
    )


class CachingBackend:
    """A server with a prefix cache of full `BLOCK`-token blocks keyed by salt; replies two tokens."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.prompts: list[list[int]] = []
        self.admin: list[str] = []
        self.metrics_text = embedded_metrics()
        self.hold: asyncio.Event | None = None  # set: generate waits for it
        self._cached: set[tuple[str | None, tuple[int, ...]]] = set()

    async def generate(self, request: GenerateRequest) -> GenerateResponse:
        self.prompts.append(request.prompt_token_ids)
        ids, salt = request.prompt_token_ids, request.cache_salt
        hit = 0
        while (hit + 1) * BLOCK < len(ids) and (salt, tuple(ids[: (hit + 1) * BLOCK])) in self._cached:
            hit += 1
        if self.hold is not None:
            await self.hold.wait()
        await asyncio.sleep(0)
        reply = [7, 8]
        full = [*ids, *reply[:-1]]
        self._cached.update((salt, tuple(full[: n * BLOCK])) for n in range(1, len(full) // BLOCK + 1))
        return GenerateResponse(
            token_ids=reply,
            logprobs=[0.0, 0.0],
            policy_versions=[0, 0],
            finish_reason="stop",
            num_cached_tokens=hit * BLOCK,
        )

    async def pause(self, request: PauseRequest) -> PauseResponse:
        self.admin.append("pause")
        return PauseResponse(paused=True, mode=request.mode, num_aborted=0)

    async def resume(self) -> ResumeResponse:
        self.admin.append("resume")
        return ResumeResponse(paused=False)

    async def update_weights(self, request: UpdateWeightsRequest) -> UpdateWeightsResponse:
        self.admin.append(f"update:{request.version}")
        return UpdateWeightsResponse(version=request.version, load_seconds=0.0, paused_seconds=0.0)

    async def weights(self) -> WeightsInfo:
        self.admin.append("weights")
        return WeightsInfo(version=0)

    async def health(self, timeout_s: float) -> bool:
        return True

    async def metrics(self) -> str:
        return self.metrics_text

    async def aclose(self) -> None:
        pass


def _pool(n: int, **router_kw) -> tuple[ServerPool, list[CachingBackend]]:
    """A pool over `n` idle servers, polled once (so routing hashes `BLOCK`-token blocks, as they do)."""
    backends = [CachingBackend(f"mem://{i}") for i in range(n)]
    pool = ServerPool(backends, router=Router(**router_kw))
    asyncio.run(pool.poll_loads())
    return pool, backends


def _ask(pool: ServerPool, session: str, prompt: list[int], salt: str | None = "0"):
    return pool.session(session).generate(prompt, SamplingParams(max_tokens=2), cache_salt=salt)


def test_prefix_hashes_chain_blocks_under_the_salt():
    ids = list(range(10))
    h = prefix_hashes(ids, 4, "s")
    assert len(h) == 2  # full blocks only
    assert prefix_hashes([*ids[:8], 99, 98], 4, "s") == h  # the partial tail does not count
    assert prefix_hashes(ids, 4, "t")[0] != h[0]  # another salt, other keys
    assert prefix_hashes([9, 9, 9, 9, *ids[4:8]], 4, "s")[1] != h[1]  # chained on the block before
    assert prefix_hashes(list(range(14)), 4, "s", known=h[:1]) == prefix_hashes(list(range(14)), 4, "s")


def test_prefix_index_is_a_bounded_lru():
    index = PrefixIndex(capacity=3)
    a, b, c, d = (bytes([i]) for i in range(4))
    index.add([a, b, c])
    index.add([a])  # a is used again: b is now the oldest
    index.add([d])
    assert len(index) == 3 and index.match([a]) == 1 and index.match([b]) == 0
    assert index.match([a, b, c]) == 1  # the leading run only


def test_cache_aware_sends_a_new_episode_to_the_server_holding_its_system_prompt():
    pool, backends = _pool(3, max_extra_requests=8)

    async def go():
        await _ask(pool, "a/0", [*SYSTEM_A, 1, 2])  # no server holds anything: the least loaded, 0
        await _ask(pool, "b/0", [*SYSTEM_B, 1, 2])
        # a busy server 0 is still within the bound: the same system prompt goes back to it
        pool.servers[0].in_flight = 2
        await _ask(pool, "a/1", [*SYSTEM_A, 5, 6])
        await _ask(pool, "b/1", [*SYSTEM_B, 5, 6])

    asyncio.run(go())
    firsts = {tuple(p[:4]): b.url for b in backends for p in b.prompts}
    assert firsts[tuple(SYSTEM_A[:4])] != firsts[tuple(SYSTEM_B[:4])]  # spread when nothing is shared
    where = [(b.url, p[0]) for b in backends for p in b.prompts]
    assert sorted(where) == sorted([("mem://0", 100), ("mem://0", 100), ("mem://1", 200), ("mem://1", 200)])
    stats = pool.stats.take()
    # the second request of each prompt found its 6 system blocks cached (the last token is recomputed)
    assert stats["inference/prefix_hit_rate"] == (2 * 24) / (4 * 26)


def test_a_later_turn_follows_its_completion_s_blocks():
    pool, backends = _pool(2)
    first = [*SYSTEM_A[:6], 1]

    async def go():
        out = await _ask(pool, "e", first)
        # another session whose prompt extends that turn's prompt + reply finds it on server 0,
        # even with server 0 busier (within the bound)
        pool.servers[0].in_flight = 3
        await _ask(pool, "other", [*first, *out.token_ids, 3, 4, 5, 6])

    asyncio.run(go())
    assert len(backends[0].prompts) == 2 and backends[1].prompts == []


def test_salts_keep_equal_prefixes_apart():
    pool, backends = _pool(2)

    async def go():
        await _ask(pool, "v0", [*SYSTEM_A, 1], salt="0")
        pool.servers[0].in_flight = 1  # server 0 is busier: without a match, the other one
        await _ask(pool, "v1", [*SYSTEM_A, 1], salt="1")
        await _ask(pool, "v0b", [*SYSTEM_A, 2], salt="0")

    asyncio.run(go())
    assert [p[-1] for p in backends[0].prompts] == [1, 2]  # salt 0 twice
    assert [p[-1] for p in backends[1].prompts] == [1]  # salt 1 went to the idle server


def _second_request_goes_to(in_flight: int = 0, kv_usage: tuple[float, float] | None = None) -> str:
    """Where a request sharing its system prompt with one already on server 0 goes, with server 0
    `in_flight` requests busier than server 1 and (when given) these reported KV usages."""
    pool, backends = _pool(2, max_extra_requests=2, max_extra_kv=0.25)

    async def go():
        await _ask(pool, "a/0", [*SYSTEM_A, 1])
        pool.servers[0].in_flight = in_flight
        if kv_usage is not None:
            for server, usage in zip(pool.servers, kv_usage, strict=True):
                server.load = ServerLoad(kv_usage=usage)
        await _ask(pool, "a/1", [*SYSTEM_A, 2])

    asyncio.run(go())
    return next(b.url for b in backends if [*SYSTEM_A, 2] in b.prompts)


def test_the_imbalance_bound_overrides_affinity_by_requests_and_by_kv():
    assert _second_request_goes_to(in_flight=2) == "mem://0"  # 2 <= 0 + 2: the prefix wins
    assert _second_request_goes_to(in_flight=3) == "mem://1"  # 3 > 0 + 2: too busy for affinity
    assert _second_request_goes_to(kv_usage=(0.35, 0.1)) == "mem://0"  # 0.35 <= 0.1 + 0.25
    assert _second_request_goes_to(kv_usage=(0.4, 0.1)) == "mem://1"  # 0.4 > 0.1 + 0.25


def test_the_bound_is_measured_from_one_least_loaded_server():
    # the fewest requests on one server, the lowest KV usage on another: the first is the least
    # loaded, the second too busy (requests) and the third too full (KV) next to it
    pool, _ = _pool(3, max_extra_requests=2, max_extra_kv=0.25)
    for server, (requests, usage) in zip(pool.servers, [(0, 0.5), (3, 0.0), (1, 0.9)], strict=True):
        server.in_flight, server.load, server.in_flight_at_poll = (
            requests,
            ServerLoad(kv_usage=usage),
            requests,
        )
    assert pool.router.choose(pool.servers, pool.servers[2], []) is pool.servers[0]


def test_reported_queues_count_as_load_until_the_next_poll():
    pool, backends = _pool(2, max_extra_requests=1)
    backends[0].metrics_text = embedded_metrics(running=5)

    async def go():
        await pool.poll_loads()
        await _ask(pool, "x", [1, 2])  # server 0 reports 5 running: the idle server 1

    asyncio.run(go())
    assert backends[1].prompts == [[1, 2]]
    assert pool.servers[0].num_requests == 5 and pool.servers[1].num_requests == 0


def test_least_loaded_and_random_keep_today_s_placement():
    pool, backends = _pool(2, mode="least_loaded")

    async def go(p):
        await asyncio.gather(_ask(p, "s1", [*SYSTEM_A, 1]), _ask(p, "s2", [*SYSTEM_A, 1]))
        await _ask(p, "s3", [*SYSTEM_A, 2])  # nothing in flight: the first server, prefix or not
        await _ask(p, "s2", [*SYSTEM_A, 1, 7, 9])  # sticky

    asyncio.run(go(pool))
    assert [p[-1] for p in backends[0].prompts] == [1, 2] and [p[-1] for p in backends[1].prompts] == [1, 9]

    picks = []
    for seed in (0, 0, 1):
        pool, backends = _pool(4, mode="random", seed=seed)
        for i in range(8):
            asyncio.run(_ask(pool, f"s{i}", [i]))
        asyncio.run(_ask(pool, "s0", [0, 7, 5]))  # sticky
        picks.append([next(b.url for b in backends if [i] in b.prompts) for i in range(8)])
        assert [0, 7, 5] in next(b for b in backends if [0] in b.prompts).prompts
    assert picks[0] == picks[1] != picks[2]  # seeded
    assert len(set(picks[0])) > 1


def test_block_size_and_index_size_come_from_the_servers_metrics():
    pool, backends = _pool(2)
    for b in backends:
        b.metrics_text = embedded_metrics(used=10, free=90, block_size=32)
    asyncio.run(pool.poll_loads())
    assert pool.router.block_size == 32
    assert [s.prefix.capacity for s in pool.servers] == [100, 100]
    assert pool.servers[0].kv_usage == 0.1


def test_a_router_url_gets_every_generation_request_and_the_servers_every_admin_call():
    cfg = OrchestratorConfig(model="m", servers=["http://a:1", "http://b:1"], routing="http://router:9/")
    assert cfg.router_url == "http://router:9"
    servers = [CachingBackend("http://a:1"), CachingBackend("http://b:1")]
    router = CachingBackend("http://router:9")
    pool = ServerPool.from_config(cfg, servers, router)

    async def go():
        await asyncio.gather(*(_ask(pool, f"s{i}", [*SYSTEM_A, i]) for i in range(3)))
        await pool.call_all(lambda b: b.update_weights(UpdateWeightsRequest(path="/w", version=1)))
        await pool.call_all(lambda b: b.weights())
        await pool.wait_ready(1.0)

    asyncio.run(go())
    assert len(router.prompts) == 3 and router.admin == []
    assert all(s.prompts == [] and s.admin == ["update:1", "weights"] for s in servers)
    assert pool.stats.take()["inference/requests"] == 3


def test_a_vllm_router_url_moves_its_salt_epoch_and_context_floor_with_the_servers_updates():
    sent: list[dict] = []

    def vllm_router(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        sent.append(body)
        n = body["sampling_params"]["max_tokens"]
        choice = {
            "index": 0,
            "finish_reason": "length",
            "token_ids": list(range(n)),
            "logprobs": {"content": [{"token_id": i, "logprob": -1.0} for i in range(n)]},
            "weight_versions": [{"version": "2", "start": 0, "end": n}],
        }
        return httpx.Response(200, json={"choices": [choice]})

    gateway = VLLMBackend("http://router/", transport=httpx.MockTransport(vllm_router))
    servers = [CachingBackend("http://a:1"), CachingBackend("http://b:1")]
    pool = ServerPool(servers, gateway=gateway)

    async def go():
        before = await _ask(pool, "s", [1, 2], salt="1")
        await pool.call_all(lambda b: b.update_weights(UpdateWeightsRequest(path="/w", version=2)))
        after = await _ask(pool, "s", [1, 2], salt="2")
        return before, after

    before, after = asyncio.run(go())
    assert before.context_version == 0 and after.context_version == 2  # the floor follows the load
    salt_before, salt_after = sent[0]["cache_salt"], sent[1]["cache_salt"]
    assert salt_before.startswith("1|") and salt_after.startswith("2|")
    assert salt_before.split("|")[1].split(".")[1] == "0" and salt_after.split("|")[1].split(".")[1] == "1"
