"""VLLMBackend: the InferenceBackend seam mapped onto vLLM's endpoints (mock transport, no vLLM)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from asyncrl.envs import InferenceBackend, InferenceError, ServerUnavailable
from asyncrl.envs.vllm_backend import VLLMBackend
from asyncrl.wire import GenerateRequest, PauseRequest, UpdateWeightsRequest


def _generate_answer(body: dict) -> dict:
    n = body["sampling_params"]["max_tokens"]
    return {
        "choices": [
            {
                "index": 0,
                "finish_reason": "length",
                "token_ids": list(range(n)),
                "logprobs": {"content": [{"token_id": i, "logprob": -1.0} for i in range(n)]},
                "weight_versions": [
                    {"version": "default", "start": 0, "end": 1},
                    {"version": "2", "start": 1, "end": n},
                ],
            }
        ]
    }


class FakeVLLM:
    """Records calls; answers as vLLM 0.32 does."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict | None]] = []
        self.label = "default"

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        body = json.loads(request.content) if request.content else None
        self.calls.append(
            (request.method, path + (f"?{request.url.query.decode()}" if request.url.query else ""), body)
        )
        if path == "/inference/v1/generate":
            return httpx.Response(200, json=_generate_answer(body))
        if path == "/update_weight_version":
            self.label = body["new_version"]
            return httpx.Response(200, json={"success": True, "new_version": self.label})
        if path == "/weight_info":
            return httpx.Response(200, json={"weight_version": self.label})
        if path == "/collective_rpc":
            return httpx.Response(200, json={"results": [None]})
        return httpx.Response(200, json={"status": "ok"})


def _backend(handler) -> VLLMBackend:
    return VLLMBackend("http://vllm/", transport=httpx.MockTransport(handler))


def test_generate_speaks_inference_v1_generate():
    fake = FakeVLLM()

    async def go():
        b = _backend(fake)
        assert isinstance(b, InferenceBackend)
        out = await b.generate(GenerateRequest(prompt_token_ids=[3, 4], max_tokens=3, cache_salt="2"))
        await b.aclose()
        return out

    out = asyncio.run(go())
    method, path, body = fake.calls[0]
    assert (method, path) == ("POST", "/inference/v1/generate")
    assert body["token_ids"] == [3, 4] and body["cache_salt"] == "2"
    assert out.token_ids == [0, 1, 2] and out.policy_versions == [0, 2, 2]


def test_update_inside_a_pause_reloads_and_labels_the_version():
    fake = FakeVLLM()

    async def go():
        b = _backend(fake)
        await b.pause(PauseRequest(mode="keep"))
        res = await b.update_weights(UpdateWeightsRequest(path="/run/weights/step_5", version=5))
        await b.resume()
        info = await b.weights()
        await b.aclose()
        return res, info

    res, info = asyncio.run(go())
    assert [c[1] for c in fake.calls] == [
        "/pause?mode=keep", "/collective_rpc", "/update_weight_version", "/resume", "/weight_info",
    ]  # fmt: skip
    assert fake.calls[1][2] == {
        "method": "asyncrl_reload_weights",
        "kwargs": {"weights_path": "/run/weights/step_5"},
    }
    assert fake.calls[2][2] == {"new_version": "5"}
    assert res.version == 5 and res.load_seconds >= 0
    assert info.version == 5


def test_update_outside_a_pause_pauses_around_the_reload():
    fake = FakeVLLM()

    async def go():
        b = _backend(fake)
        await b.update_weights(UpdateWeightsRequest(path="/w", version=1, mode="abort"))
        await b.aclose()

    asyncio.run(go())
    assert [c[1] for c in fake.calls] == [
        "/pause?mode=abort",
        "/collective_rpc",
        "/update_weight_version",
        "/resume",
    ]


def test_errors_are_named_by_kind():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/inference/v1/generate":
            return httpx.Response(400, json={"error": {"message": "token_ids: bad"}})
        if request.url.path == "/weight_info":
            return httpx.Response(200, json={"weight_version": "nightly"})
        return httpx.Response(503, text="engine dead")

    async def go():
        b = _backend(handler)
        with pytest.raises(InferenceError, match="400"):
            await b.generate(GenerateRequest(prompt_token_ids=[1]))
        with pytest.raises(ServerUnavailable, match="503"):
            await b.pause(PauseRequest())
        with pytest.raises(InferenceError, match="nightly"):
            await b.weights()
        await b.aclose()

    asyncio.run(go())


def test_an_answer_outside_the_contract_is_an_inference_error():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"choices": [{"token_ids": [1], "finish_reason": "length"}]})

    async def go():
        b = _backend(handler)
        with pytest.raises(InferenceError, match="breaks the contract"):
            await b.generate(GenerateRequest(prompt_token_ids=[1]))
        await b.aclose()

    asyncio.run(go())
