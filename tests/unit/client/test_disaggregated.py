"""DisaggregatedBackend: a prefill and a decode vLLM server as one backend (mock transports, no vLLM).

The fakes answer as vLLM 0.32 with a KV connector does: a prefill hop (`do_remote_decode`) samples
one token and returns the parameters that locate its KV; a decode hop brings them back.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from asyncrl.client import InferenceBackend, InferenceError, build_backends
from asyncrl.client.disaggregated import DisaggregatedBackend, KVHandoffBackend
from asyncrl.wire import GenerateRequest, UpdateWeightsRequest


class FakeServer:
    """One vLLM server with a KV connector: records its calls, stamps tokens with its weights label."""

    def __init__(self, name: str, label: str = "default") -> None:
        self.name, self.label = name, label
        self.calls: list[tuple[str, dict | None]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        body = json.loads(request.content) if request.content else None
        self.calls.append((path, body))
        if path == "/inference/v1/generate":
            return httpx.Response(200, json=self._generate(body))
        if path == "/update_weight_version":
            self.label = body["new_version"]
        if path == "/weight_info":
            return httpx.Response(200, json={"weight_version": self.label})
        return httpx.Response(200, json={"status": "ok"})

    def _generate(self, body: dict) -> dict:
        n = body["sampling_params"]["max_tokens"]
        params = body.get("kv_transfer_params") or {}
        handoff = None
        if params.get("do_remote_decode"):
            handoff = {"do_remote_prefill": True, "remote_engine_id": self.name, "remote_block_ids": [7, 8]}
        choice = {
            "finish_reason": "length",
            "token_ids": [100 + i for i in range(n)],
            "logprobs": {"content": [{"logprob": -0.5} for _ in range(n)]},
            "weight_versions": [{"version": self.label, "start": 0, "end": n}],
        }
        cached = 16 if self.name == "prefill" else 0
        usage = {"prompt_tokens_details": {"cached_tokens": cached}}
        return {"choices": [choice], "usage": usage, "kv_transfer_params": handoff}

    def paths(self) -> list[str]:
        return [p for p, _ in self.calls]


def _pair(prefill: FakeServer, decode: FakeServer) -> DisaggregatedBackend:
    return DisaggregatedBackend(
        KVHandoffBackend("http://p", transport=httpx.MockTransport(prefill)),
        KVHandoffBackend("http://d", transport=httpx.MockTransport(decode)),
    )


def test_a_request_is_prefilled_for_one_token_then_decoded_with_the_returned_kv_params():
    prefill, decode = FakeServer("prefill"), FakeServer("decode")
    pair = _pair(prefill, decode)
    assert isinstance(pair, InferenceBackend)
    request = GenerateRequest(prompt_token_ids=[1, 2, 3], max_tokens=4, cache_salt="5", temperature=0.7)
    out = asyncio.run(pair.generate(request))
    (_, first), (_, second) = prefill.calls[0], decode.calls[0]
    assert first["sampling_params"]["max_tokens"] == 1 and first["kv_transfer_params"]["do_remote_decode"]
    assert second["sampling_params"]["max_tokens"] == 4 and second["sampling_params"]["temperature"] == 0.7
    assert second["kv_transfer_params"] == {
        "do_remote_prefill": True,
        "remote_engine_id": "prefill",
        "remote_block_ids": [7, 8],
    }
    assert first["token_ids"] == second["token_ids"] == [1, 2, 3]
    # one salt on both hops: the caller's, keyed by the pair's weights epoch
    assert first["cache_salt"] == second["cache_salt"] == f"5|{pair.epoch_key}"
    assert out.token_ids == [100, 101, 102, 103] and out.policy_versions == [0, 0, 0, 0]
    assert out.num_cached_tokens == 16  # the prefill server's prefix-cache hit


def test_versions_are_the_decode_servers_and_the_context_version_is_the_prefills_when_older():
    prefill, decode = FakeServer("prefill", label="3"), FakeServer("decode", label="4")
    pair = _pair(prefill, decode)
    pair._version = 4  # the pair loaded v4 into both; the prefill server still answers with v3 KV
    out = asyncio.run(pair.generate(GenerateRequest(prompt_token_ids=[1], max_tokens=2)))
    assert out.policy_versions == [4, 4]  # the decode server's stamps
    assert out.context_version == 3  # the prompt's KV was computed by the prefill's v3
    prefill.label = "4"
    out = asyncio.run(pair.generate(GenerateRequest(prompt_token_ids=[1], max_tokens=2)))
    assert out.context_version == 4


def test_an_update_pauses_both_servers_reloads_both_and_starts_a_new_epoch_for_both_hops():
    prefill, decode = FakeServer("prefill"), FakeServer("decode")
    pair = _pair(prefill, decode)

    async def go():
        before = pair.epoch_key
        answer = await pair.update_weights(UpdateWeightsRequest(path="/run/weights/step_2", version=2))
        out = await pair.generate(GenerateRequest(prompt_token_ids=[1], max_tokens=1, cache_salt="2"))
        return before, answer, out, await pair.weights()

    before, answer, out, weights = asyncio.run(go())
    for server in (prefill, decode):
        paths = server.paths()
        assert paths[:4] == ["/pause", "/pause", "/collective_rpc", "/update_weight_version"]
        assert paths[4] == "/resume" and server.label == "2"
    assert answer.version == 2 and weights.version == 2
    assert pair.epoch_key != before
    salts = {server.calls[5][1]["cache_salt"] for server in (prefill, decode)}
    assert salts == {f"2|{pair.epoch_key}"}
    assert out.context_version == 2


def test_a_prefill_server_without_a_connector_is_an_error_that_says_so():
    class NoConnector(FakeServer):
        def _generate(self, body: dict) -> dict:
            return super()._generate(body | {"kv_transfer_params": None})

    pair = _pair(NoConnector("prefill"), FakeServer("decode"))
    with pytest.raises(InferenceError, match="without kv_transfer_params: start it with a KV connector"):
        asyncio.run(pair.generate(GenerateRequest(prompt_token_ids=[1], max_tokens=2)))


def test_build_backends_pairs_each_server_with_its_prefill_server():
    pairs = build_backends(["http://d0", "http://d1"], kind="vllm", prefill_urls=["http://p0", "http://p1"])
    assert [(b.prefill.url, b.decode.url, b.url) for b in pairs] == [
        ("http://p0", "http://d0", "http://d0"),
        ("http://p1", "http://d1", "http://d1"),
    ]
    with pytest.raises(ValueError, match="one prefill URL per server"):
        build_backends(["http://d0"], kind="embedded", prefill_urls=["http://p0"])
