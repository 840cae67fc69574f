"""The embedded server also speaks vLLM's token-in/token-out shape (`POST /inference/v1/generate`),
so one client (`VLLMBackend`, or any vLLM client) gets the same answers from either backend."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from asyncrl.client import HttpBackend, VLLMBackend
from asyncrl.client.disaggregated import PREFILL_KV_TRANSFER_PARAMS, DisaggregatedBackend, KVHandoffBackend
from asyncrl.wire import GenerateRequest, PauseRequest


def test_vllm_client_and_asyncrl_client_get_the_same_answer(server):
    req = GenerateRequest(
        prompt_token_ids=[256, *range(65, 105)],
        max_tokens=12,
        temperature=0.0,
        ignore_eos=True,
        cache_salt="7",
        return_routed_experts=True,
        routed_experts_start=4,
    )

    async def go():
        ours, theirs = (
            HttpBackend(server.url, api_key=server.api_key),
            VLLMBackend(server.url, api_key=server.api_key),
        )
        try:
            return await ours.generate(req), await theirs.generate(req), await theirs.generate(req)
        finally:
            await ours.aclose()
            await theirs.aclose()

    a, b, again = asyncio.run(go())
    assert b.token_ids == a.token_ids and b.policy_versions == a.policy_versions == [0] * 12
    assert b.logprobs == pytest.approx(a.logprobs, abs=1e-6)
    assert b.finish_reason == a.finish_reason == "length"
    # VLLMBackend adds its weights epoch to the salt: it shares blocks with its own requests only
    assert b.num_cached_tokens == 0 and again.num_cached_tokens > 0
    assert a.routed_experts is not None and b.routed_experts is not None
    assert b.routed_experts.start == a.routed_experts.start == 4
    np.testing.assert_array_equal(b.routed_experts.to_array(), a.routed_experts.to_array())


def test_raw_vllm_shape_and_its_errors(server):
    with server.client() as c:
        body = {
            "token_ids": [256, 65, 66],
            "sampling_params": {"max_tokens": 3, "temperature": 0, "logprobs": 0},
        }
        r = c.post("/inference/v1/generate", json=body | {"request_id": "r-1"})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["request_id"] == "r-1" and out["output_mode"] == "tokens"
        choice = out["choices"][0]
        assert len(choice["token_ids"]) == 3 and len(choice["logprobs"]["content"]) == 3
        assert choice["weight_versions"] == [{"version": "0", "start": 0, "end": 3}]
        assert out["usage"]["prompt_tokens"] == 3 and out["usage"]["completion_tokens"] == 3
        for bad, param in [
            ({"sampling_params": {"max_tokens": 0}}, "sampling_params.max_tokens"),
            ({"sampling_params": {"n": 2}}, "sampling_params.n"),
            ({"stream": True}, "stream"),
            ({"token_ids": []}, "token_ids"),
            ({"token_ids": [999999]}, "token_ids"),
        ]:
            r = c.post("/inference/v1/generate", json=body | bad)
            assert r.status_code == 400, (bad, r.text)
            assert r.json()["error"]["param"] == param, (bad, r.json())


def test_pause_takes_vllm_s_query_mode(server):
    async def go():
        b = VLLMBackend(server.url, api_key=server.api_key)
        try:
            paused = await b.pause(PauseRequest(mode="abort"))
            with server.client() as c:
                metrics = c.get("/metrics").text
                clash = c.post("/pause", params={"mode": "keep"}, json={"mode": "abort"})
            await b.resume()
            return paused, metrics, clash
        finally:
            await b.aclose()

    paused, metrics, clash = asyncio.run(go())
    assert paused.mode == "abort" and "asyncrl_paused 1" in metrics
    assert clash.status_code == 400 and clash.json()["error"]["param"] == "mode"


def test_a_prefill_decode_pair_of_embedded_servers_answers_as_one_server(server):
    # The embedded server has no KV connector: it answers a prefill hop with parameters that name no
    # blocks, and the decode hop computes the prompt itself (docs/inference.md, "Prefill/decode").
    req = GenerateRequest(
        prompt_token_ids=[256, *range(65, 95)], max_tokens=8, temperature=0.0, ignore_eos=True, cache_salt="3"
    )

    async def go():
        one = VLLMBackend(server.url, api_key=server.api_key)
        hops = [KVHandoffBackend(server.url, api_key=server.api_key) for _ in range(2)]
        pair = DisaggregatedBackend(*hops)
        try:
            return await one.generate(req), await pair.generate(req)
        finally:
            await one.aclose()
            await pair.aclose()

    alone, paired = asyncio.run(go())
    assert paired.token_ids == alone.token_ids and paired.policy_versions == [0] * 8
    assert paired.logprobs == pytest.approx(alone.logprobs, abs=1e-6)
    assert paired.context_version == 0
    with server.client() as c:
        body = {"token_ids": [256, 65], "sampling_params": {"max_tokens": 1}, "request_id": "p-1"}
        prefill = c.post(
            "/inference/v1/generate", json=body | {"kv_transfer_params": PREFILL_KV_TRANSFER_PARAMS}
        )
        assert prefill.status_code == 200, prefill.text
        handoff = prefill.json()["kv_transfer_params"]
        assert handoff["do_remote_prefill"] is True and handoff["remote_block_ids"] == []
        assert handoff["remote_request_id"] == "p-1"
        decode = c.post("/inference/v1/generate", json=body | {"kv_transfer_params": handoff})
        assert decode.status_code == 200 and decode.json()["kv_transfer_params"] is None
