"""An episode that reaches the server's context limit is a length stop, trained as truncated, never a
failure: failing it would drop long episodes from training and from their group's baseline."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import httpx
import pytest

from asyncrl.client import ContextLimitExceeded, HttpInferenceClient, InferenceError, VLLMBackend
from asyncrl.config import EnvConfig
from asyncrl.config.inference import InferenceConfig
from asyncrl.envs import Environment, Reward, Rubric, ScriptedClient, Task, TokenPolicy, run_episode
from asyncrl.inference.main import build_server_app
from asyncrl.tools.init_model import init_model
from asyncrl.wire import GenerateRequest, SamplingParams

REPLY = "abcdefghij"  # 10 byte tokens, then eos


class TalkativeEnv(Environment):
    """Answers every model turn with "more": episodes grow until a token limit ends them."""

    name = "talkative"
    max_turns = 50
    rubric = Rubric(rewards=(Reward(name="turns", fn=lambda state: float(state.num_turns)),))

    def task(self, split, index):
        return Task(id=f"talkative/{index}", prompt=[{"role": "user", "content": "go"}])

    def reference(self, task):
        return []

    async def respond(self, state, text):
        return [{"role": "user", "content": "more"}]


@dataclass
class LimitedClient(ScriptedClient):
    """A scripted server with a context limit: it refuses a request that does not fit, as servers do."""

    limit: int = 0
    requests: list[tuple[int, int]] = field(default_factory=list)  # (prompt tokens, max_tokens)

    async def _answer(self, request: GenerateRequest):
        n, max_tokens = len(request.prompt_token_ids), request.max_tokens
        self.requests.append((n, max_tokens))
        if n + max_tokens > self.limit:
            raise ContextLimitExceeded(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds the context limit {self.limit}"
            )
        return await super()._answer(request)


def _run(policy: TokenPolicy, cfg: EnvConfig):
    env = TalkativeEnv()
    return asyncio.run(run_episode(env, env.task("train", 0), policy, config=cfg, episode_id="ep"))


def _num_sampled(episode) -> int:
    return sum(int(s.loss_mask.sum()) for s in episode.samples)


def test_a_policy_that_knows_the_context_limit_never_sends_a_request_that_does_not_fit(tokenizer):
    cfg = EnvConfig(name="talkative", max_total_tokens=4096)
    client = LimitedClient(tokenizer, lambda i, prompt: REPLY, limit=150)
    policy = TokenPolicy(client, tokenizer, SamplingParams(max_tokens=32), config=cfg, max_model_len=150)
    episode = _run(policy, cfg)
    assert episode.stop_reason == "context_limit" and not episode.failed
    assert all(n + max_tokens <= 150 for n, max_tokens in client.requests)  # none refused
    assert sum(client.requests[-1]) == 150  # the last turn was capped by the context, not by max_tokens
    assert episode.reward == episode.metrics["num_turns"] == len(client.requests) >= 3
    assert len(episode.samples) == 1 and episode.samples[0].num_tokens <= 150


def test_a_refusal_for_length_ends_the_episode_as_a_length_stop_that_keeps_its_turns(tokenizer):
    cfg = EnvConfig(name="talkative", max_total_tokens=4096)
    client = LimitedClient(tokenizer, lambda i, prompt: REPLY, limit=160)
    policy = TokenPolicy(client, tokenizer, SamplingParams(max_tokens=32), config=cfg)  # limit unknown
    episode = _run(policy, cfg)
    n, max_tokens = client.requests[-1]
    assert n + max_tokens > 160  # the server refused the last request
    assert episode.stop_reason == "context_limit" and episode.error is None and not episode.failed
    turns = episode.metrics["num_turns"]
    assert turns == len(client.requests) - 1 >= 3 and episode.reward == turns  # scored on what it did
    assert _num_sampled(episode) == (len(REPLY) + 1) * turns  # every answered turn is trained
    assert episode.metrics["stop_context_limit"] == 1.0


def test_vllm_refusals_for_length_are_context_limit_errors_and_others_are_not():
    def answer(message: str):
        body = {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}
        return VLLMBackend(
            "http://vllm", transport=httpx.MockTransport(lambda r: httpx.Response(400, json=body))
        )

    async def generate(backend) -> None:
        await backend.generate(GenerateRequest(prompt_token_ids=[1] * 600, max_tokens=8))

    too_long = (
        "The decoder prompt (length 600) is longer than the maximum model length of 512. Make sure that "
        "`max_model_len` is no smaller than the number of text tokens."
    )
    with pytest.raises(ContextLimitExceeded, match="maximum model length of 512"):
        asyncio.run(generate(answer(too_long)))
    with pytest.raises(InferenceError, match="min_tokens") as other:
        asyncio.run(generate(answer("min_tokens must be less than or equal to max_tokens=8, got 9.")))
    assert not isinstance(other.value, ContextLimitExceeded)


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    """The embedded engine's HTTP app over a tiny random MoE model with a 96-token context."""
    model_dir = tmp_path_factory.mktemp("tiny-moe")
    init_model("tiny-moe", model_dir, seed=0)
    cfg = InferenceConfig(model=str(model_dir), max_model_len=96, kv_cache_tokens=1024, device="cpu")
    return build_server_app(cfg)


def test_the_embedded_servers_refusal_for_length_is_a_length_stop(tiny_server, tokenizer):
    cfg = EnvConfig(name="talkative", max_total_tokens=2048)

    async def go():
        async with tiny_server.router.lifespan_context(tiny_server):
            client = HttpInferenceClient("http://tiny", transport=httpx.ASGITransport(app=tiny_server))
            with pytest.raises(ContextLimitExceeded, match="context limit 96"):
                await client.generate([65] * 90, SamplingParams(max_tokens=10))
            with pytest.raises(InferenceError, match="outside the vocabulary") as other:
                await client.generate([10**6], SamplingParams(max_tokens=1))
            assert not isinstance(other.value, ContextLimitExceeded)
            env = TalkativeEnv()
            policy = TokenPolicy(client, tokenizer, SamplingParams(max_tokens=16), config=cfg)
            return await run_episode(env, env.task("train", 0), policy, config=cfg, episode_id="ep")

    episode = asyncio.run(go())
    assert episode.stop_reason == "context_limit" and not episode.failed
    assert episode.metrics["num_turns"] >= 2 and _num_sampled(episode) >= 2
