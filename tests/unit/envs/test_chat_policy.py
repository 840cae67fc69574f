"""ChatPolicy: the rollout loop over an OpenAI-compatible chat endpoint (mock server)."""

from __future__ import annotations

import asyncio
import json

import httpx

from asyncrl.config import EnvConfig
from asyncrl.envs import ChatPolicy, build_env, run_episode
from asyncrl.wire import SamplingParams


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
