"""The HTTP inference client (/v1/generate) and the OpenAI-compatible evaluation adapter, on mock servers."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest

from asyncrl.config import EnvConfig
from asyncrl.envs import (
    ChatPolicy,
    HttpInferenceClient,
    InferenceClient,
    InferenceError,
    build_env,
    run_episode,
)
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
                [1, 2], SamplingParams(temperature=0.5, max_tokens=7), cache_salt="3", return_routed_experts=True,
                routed_experts_start=1,
            )  # fmt: skip

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


def test_chat_policy_evaluates_a_served_model_without_samples():
    env = build_env("calculator")
    task = env.task("eval", 0)
    answer = int(task.answer)
    requests = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        requests.append(body)
        if len(requests) == 1:  # a model with native tool calling
            call = {
                "id": "c1",
                "type": "function",
                "function": {
                    "name": "calc",
                    "arguments": json.dumps({"expression": task.info["expression"]}),
                },
            }
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
        else:
            message = {"role": "assistant", "content": f"The answer is {answer}."}
        usage = {"prompt_tokens": 30, "completion_tokens": 5}
        return httpx.Response(
            200, json={"choices": [{"message": message, "finish_reason": "stop"}], "usage": usage}
        )

    async def go():
        async with httpx.AsyncClient(base_url="http://srv", transport=httpx.MockTransport(handler)) as http:
            policy = ChatPolicy(http, "served-model", SamplingParams(temperature=0.0, max_tokens=50))
            cfg = EnvConfig(name="calculator")
            return await run_episode(env, task, policy, config=cfg, episode_id="eval-0")

    ep = asyncio.run(go())
    assert ep.reward == 1.0 and ep.rewards["used_calc"] == 1.0 and ep.samples == []
    assert ep.metrics["num_tool_calls"] == 1 and ep.metrics["num_completion_tokens"] == 10
    assert requests[0]["model"] == "served-model" and requests[0]["tools"][0]["function"]["name"] == "calc"
    assert requests[1]["messages"][-1] == {"role": "tool", "name": "calc", "content": str(answer)}


def test_eval_env_command_on_a_mock_server(capsys, monkeypatch):
    from asyncrl.envs import endpoint_eval
    from asyncrl.launcher.cli import main as cli_main

    def handler(request: httpx.Request) -> httpx.Response:
        prompt = json.loads(request.content)["messages"][-1]["content"]
        word = prompt.removeprefix("reverse: ")
        answer = word[::-1] if len(word) % 2 else word  # right on odd lengths only
        return httpx.Response(
            200, json={"choices": [{"message": {"content": answer}, "finish_reason": "stop"}]}
        )

    real_client = httpx.AsyncClient
    monkeypatch.setattr(
        endpoint_eval.httpx,
        "AsyncClient",
        lambda **kw: real_client(transport=httpx.MockTransport(handler), **kw),
    )
    assert cli_main(["eval-env", "--base-url", "http://srv", "--env", "reverse-text", "--num", "20"]) == 0
    out = capsys.readouterr().out
    env = build_env("reverse-text")
    words = [env.task("eval", i).answer for i in range(20)]
    expected_exact = sum(len(w) % 2 == 1 for w in words) / 20
    rows = dict(line.split() for line in out.splitlines()[1:])
    assert float(rows["rewards/exact"]) == pytest.approx(expected_exact, abs=1e-4)
    assert float(rows["num_episodes"]) == 20
    assert "metrics/num_turns" in out and "reverse-text (eval, 20 episodes)" in out
