"""HttpInferenceClient: one /v1/generate request per call, a validated answer or a named error (mock
server)."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest

from asyncrl.client import HttpInferenceClient, InferenceClient, InferenceError
from asyncrl.wire import RoutedExperts, SamplingParams


def test_generate_request_and_response():
    seen = {}
    routing = np.arange(12, dtype=np.uint8).reshape(3, 2, 2)

    def handler(request: httpx.Request) -> httpx.Response:
        seen["path"], seen["auth"] = request.url.path, request.headers.get("authorization")
        seen["body"] = json.loads(request.content)
        return httpx.Response(
            200,
            json={
                "token_ids": [5, 6],
                "logprobs": [-0.5, -0.25],
                "policy_versions": [4, 4],
                "finish_reason": "stop",
                "num_cached_tokens": 2,
                "routed_experts": RoutedExperts.from_array(routing, start=1).model_dump(),
            },
        )

    async def go():
        async with HttpInferenceClient(
            "http://srv/", api_key="k", transport=httpx.MockTransport(handler)
        ) as client:
            assert isinstance(client, InferenceClient)
            return await client.generate(
                [1, 2],
                SamplingParams(temperature=0.5, max_tokens=7),
                cache_salt="3",
                return_routed_experts=True,
                routed_experts_start=1,
            )

    out = asyncio.run(go())
    assert seen["path"] == "/v1/generate" and seen["auth"] == "Bearer k"
    body = seen["body"]
    assert body["prompt_token_ids"] == [1, 2] and body["temperature"] == 0.5 and body["max_tokens"] == 7
    assert (
        body["cache_salt"] == "3"
        and body["return_routed_experts"] is True
        and body["routed_experts_start"] == 1
    )
    assert out.token_ids == [5, 6] and out.policy_versions == [4, 4] and out.num_cached_tokens == 2
    np.testing.assert_array_equal(out.routed_experts.to_array(), routing)


@pytest.mark.parametrize(
    ("status", "payload", "match"),
    [
        (400, {"error": "prompt_token_ids: empty"}, "400: .*prompt_token_ids"),
        (200, {"token_ids": [1]}, "breaks the contract"),
        (
            200,
            {"token_ids": [1, 2], "logprobs": [0.0], "policy_versions": [0, 0], "finish_reason": "stop"},
            "2 token_ids but 1 logprobs",
        ),
    ],
)
def test_generate_errors(status, payload, match):
    transport = httpx.MockTransport(lambda request: httpx.Response(status, json=payload))

    async def go():
        async with HttpInferenceClient("http://srv", transport=transport) as client:
            await client.generate([1], SamplingParams())

    with pytest.raises(InferenceError, match=match):
        asyncio.run(go())
