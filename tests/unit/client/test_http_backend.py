"""HttpBackend: every call sends a wire model and returns a validated wire model, or a named error."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest

from asyncrl.client import HttpBackend, InferenceBackend, InferenceError, ServerUnavailable
from asyncrl.wire import GenerateRequest, GenerateResponse, PauseRequest, RoutedExperts, UpdateWeightsRequest
from asyncrl.wire.binary import GENERATE_MEDIA_TYPE, encode_generate


def _backend(handler) -> HttpBackend:
    return HttpBackend("http://srv/", transport=httpx.MockTransport(handler))


def test_admin_calls_send_and_parse_the_wire_models():
    seen: list[tuple[str, str, dict | None]] = []
    answers = {
        "/pause": {"paused": True, "mode": "abort", "num_aborted": 3},
        "/update_weights": {"version": 7, "load_seconds": 0.5, "paused_seconds": 0.25},
        "/resume": {"paused": False},
        "/weights": {"version": 7, "path": "/w/step_7"},
    }

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        seen.append((request.method, request.url.path, body))
        if request.url.path == "/metrics":
            return httpx.Response(200, text="asyncrl_requests_total 4\n")
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        return httpx.Response(200, json=answers[request.url.path])

    async def go():
        b = _backend(handler)
        assert isinstance(b, InferenceBackend) and b.url == "http://srv"
        paused = await b.pause(PauseRequest(mode="abort"))
        updated = await b.update_weights(UpdateWeightsRequest(path="/w/step_7", version=7))
        resumed = await b.resume()
        held = await b.weights()
        text = await b.metrics()
        ok = await b.health(1.0)
        await b.aclose()
        return paused, updated, resumed, held, text, ok

    paused, updated, resumed, held, text, ok = asyncio.run(go())
    assert paused.num_aborted == 3 and updated.load_seconds == 0.5 and resumed.paused is False
    assert held.version == 7 and held.path == "/w/step_7" and text.startswith("asyncrl_requests_total")
    assert ok is True
    assert seen[:3] == [
        ("POST", "/pause", {"mode": "abort"}),
        (
            "POST",
            "/update_weights",
            {"path": "/w/step_7", "version": 7, "mode": "keep", "transport": "filesystem"},
        ),
        ("POST", "/resume", {}),
    ]


@pytest.mark.parametrize(
    ("status", "payload", "error", "match"),
    [
        (503, {"error": "overloaded"}, ServerUnavailable, "GET http://srv/weights -> 503"),
        (404, {"error": "no such path"}, InferenceError, "-> 404"),
        (200, {"version": -1}, InferenceError, "response breaks the contract"),
    ],
)
def test_admin_errors_say_whether_the_server_or_the_request_failed(status, payload, error, match):
    b = _backend(lambda request: httpx.Response(status, json=payload))
    with pytest.raises(error, match=match) as info:
        asyncio.run(b.weights())
    assert (info.type is ServerUnavailable) == (status >= 500)


def test_unreachable_server_is_unavailable_and_unhealthy():
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    b = _backend(refuse)
    with pytest.raises(ServerUnavailable, match="ConnectError"):
        asyncio.run(b.resume())
    assert asyncio.run(b.health(0.1)) is False


def test_generate_response_needs_one_logprob_and_version_per_token():
    ok = GenerateResponse(
        token_ids=[1, 2], logprobs=[0.0, -1.0], policy_versions=[3, 3], finish_reason="stop"
    )
    assert ok.policy_versions == [3, 3]
    with pytest.raises(ValueError, match="2 token_ids but 2 logprobs and 1 policy_versions"):
        GenerateResponse(token_ids=[1, 2], logprobs=[0.0, -1.0], policy_versions=[3], finish_reason="stop")


def test_generate_asks_for_the_binary_body_and_reads_json_from_a_server_without_it():
    rows = np.arange(4 * 3 * 2, dtype=np.uint8).reshape(4, 3, 2)
    answer = GenerateResponse(
        token_ids=[5, 6],
        logprobs=[-0.5, -1.0],
        policy_versions=[1, 1],
        finish_reason="length",
        routed_experts=RoutedExperts.from_array(rows, start=2),
    )
    accepts: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        accepts.append(request.headers["accept"])
        if json.loads(request.content)["seed"] == 1:
            return httpx.Response(
                200, content=encode_generate(answer), headers={"content-type": GENERATE_MEDIA_TYPE}
            )
        if json.loads(request.content)["seed"] == 2:
            return httpx.Response(
                200, content=answer.model_dump_json(), headers={"content-type": "application/json"}
            )
        return httpx.Response(
            200, content=encode_generate(answer)[:-1], headers={"content-type": GENERATE_MEDIA_TYPE}
        )

    async def go(seed: int) -> GenerateResponse:
        b = _backend(handler)
        try:
            return await b.generate(
                GenerateRequest(prompt_token_ids=[1, 2, 3], seed=seed, return_routed_experts=True)
            )
        finally:
            await b.aclose()

    assert asyncio.run(go(1)) == asyncio.run(go(2)) == answer
    assert asyncio.run(go(1)).routed_experts.to_array().tobytes() == rows.tobytes()
    assert all(a.startswith(GENERATE_MEDIA_TYPE) for a in accepts)
    with pytest.raises(InferenceError, match="breaks the contract: routed_experts"):
        asyncio.run(go(3))
