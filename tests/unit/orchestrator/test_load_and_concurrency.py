"""Servers' /metrics read for both backends, and the adaptive in-flight cap that follows their free KV."""

from __future__ import annotations

import asyncio

from asyncrl.config.orchestrator import OrchestratorConfig
from asyncrl.inference.metrics import _METRICS, render_metrics
from asyncrl.orchestrator.concurrency import AdaptiveCap
from asyncrl.orchestrator.load import ServerLoad, parse_metrics
from asyncrl.orchestrator.pool import ServerPool
from asyncrl.wire import SamplingParams

from .test_routing import CachingBackend, embedded_metrics

# What vLLM 0.32 serves at /metrics for a server with two data-parallel engines (abridged).
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.3
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 4096.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="1000"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="1",num_gpu_blocks="1000"} 1.0
"""


def test_the_embedded_server_s_metrics_give_queue_kv_usage_and_block_size():
    stats = dict.fromkeys(_METRICS, 0.0) | {
        "num_running": 3,
        "num_waiting": 2,
        "kv_blocks_used": 30,
        "kv_blocks_free": 98,
        "kv_cache_tokens": 128 * 16,
    }
    load = parse_metrics(render_metrics(stats, paused=False))
    assert load == ServerLoad(num_running=3, num_waiting=2, kv_usage=30 / 128, num_blocks=128, block_size=16)


def test_vllm_s_metrics_are_summed_over_its_engines():
    load = parse_metrics(VLLM_METRICS)
    assert load == ServerLoad(num_running=5, num_waiting=1, kv_usage=0.4, num_blocks=2000, block_size=16)


def test_a_server_that_reports_nothing_useful_leaves_kv_unknown():
    assert parse_metrics("") == ServerLoad()
    assert parse_metrics("asyncrl_requests_running 2\nbroken line\n").kv_usage is None


def test_the_cap_follows_free_kv_within_its_bounds_and_step():
    cap = AdaptiveCap(min_requests=4, max_requests=256, target_kv_usage=0.8)
    assert cap.value == 256  # no evidence of pressure yet
    # 10 requests hold 20% of the KV: 10 * 0.8 / 0.2 = 40 fit, reached by halving at most per poll
    assert [cap.update([ServerLoad(num_running=10, kv_usage=0.2)]) for _ in range(3)] == [128, 64, 40]
    long_episodes = [ServerLoad(num_running=10, kv_usage=0.8)] * 2  # the target reached: 10 each
    assert cap.update(long_episodes) == 20
    assert cap.update([ServerLoad(num_running=20, kv_usage=1.0)] * 2) == 32  # fuller still: 2 x 16
    short_episodes = [ServerLoad(num_running=16, kv_usage=0.1)] * 2  # room for 2 x 128
    assert [cap.update(short_episodes) for _ in range(4)] == [64, 128, 256, 256]
    assert cap.update([ServerLoad(num_running=1, kv_usage=1.0)]) == 128
    assert [cap.update([ServerLoad(num_running=1, kv_usage=1.0)]) for _ in range(6)][-1] == 4  # the floor
    assert cap.update([None, ServerLoad()]) == 8  # no KV reported: no pressure, back up


def test_the_pool_holds_requests_over_the_cap_and_releases_them_as_kv_frees():
    backends = [CachingBackend("mem://0"), CachingBackend("mem://1")]
    cap = AdaptiveCap(min_requests=1, max_requests=64, target_kv_usage=0.9)
    pool = ServerPool(backends, cap=cap)

    async def go() -> list[int]:
        for b in backends:  # 2 running requests hold 90% of each server's KV: 2 fit per server
            b.metrics_text = embedded_metrics(running=2, used=90, free=10)
            b.hold = asyncio.Event()
        for _ in range(6):  # from 64, halved per poll: 32, 16, 8, 4
            await pool.poll_loads()
        assert cap.value == 4
        tasks = [
            asyncio.create_task(pool.session(f"s{i}").generate([i], SamplingParams(max_tokens=2)))
            for i in range(10)
        ]
        for _ in range(20):
            await asyncio.sleep(0)
        sent = [sum(len(b.prompts) for b in backends)]
        for b in backends:  # KV freed: the cap doubles, more requests go out
            b.metrics_text = embedded_metrics(running=2, used=20, free=80)
        await pool.poll_loads()
        for _ in range(20):
            await asyncio.sleep(0)
        sent.append(sum(len(b.prompts) for b in backends))
        for b in backends:
            b.hold.set()
        await asyncio.gather(*tasks)
        sent.append(sum(len(b.prompts) for b in backends))
        return sent

    assert asyncio.run(go()) == [4, 8, 10]
    assert pool.stats.take()["inference/in_flight_cap"] == 8


def test_the_config_s_pool_routes_cache_aware_and_logs_its_cap_per_step():
    backends = [CachingBackend("mem://0")]
    pool = ServerPool.from_config(OrchestratorConfig(model="m"), backends, None)
    assert pool.router.mode == "cache_aware" and pool.gateway is None
    assert pool.stats.take()["inference/in_flight_cap"] == 512.0
    fixed = OrchestratorConfig(model="m", routing="random", concurrency={"adaptive": False})
    pool = ServerPool.from_config(fixed, backends, None)
    assert pool.router.mode == "random" and "inference/in_flight_cap" not in pool.stats.take()
