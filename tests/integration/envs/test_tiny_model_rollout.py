"""Episodes sampled from a real tiny MoE model: the stitched sample reproduces the sampler's logprobs.

An in-process client samples from `asyncrl.model.Transformer` (full recomputation per token, fp32)
and returns routing like `/v1/generate`. The trainer-side check then holds exactly: one forward
pass over each stitched sample, with its routed experts replayed, gives the same logprobs at every
sampled token as the sampler reported, turn after turn, with tool/env tokens in between.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from asyncrl.config import EnvConfig
from asyncrl.envs import Environment, Reward, Rubric, Task, TokenPolicy, build_env, run_episode
from asyncrl.model import Transformer, preset_args
from asyncrl.wire import GenerateResponse, RoutedExperts, SamplingParams


class TinyModelClient:
    """`InferenceClient` over an in-process model; every token carries `version`."""

    def __init__(self, model: Transformer, *, eos: int, seed: int = 0, version: int = 0) -> None:
        self.model, self.eos, self.version = model, eos, version
        self.gen = torch.Generator().manual_seed(seed)

    async def generate(
        self,
        prompt_token_ids,
        sampling,
        *,
        cache_salt=None,
        return_routed_experts=False,
        routed_experts_start=0,
    ):
        with torch.no_grad():
            return self._generate(prompt_token_ids, sampling, return_routed_experts, routed_experts_start)

    def _generate(self, prompt_token_ids, sampling, return_routed_experts, routed_experts_start):
        ids, out, logprobs = list(prompt_token_ids), [], []
        for _ in range(sampling.max_tokens):
            logits_V = self.model(torch.tensor([ids])).logits[0, -1].float() / sampling.temperature
            logp_V = torch.log_softmax(logits_V, dim=-1)
            token = int(torch.multinomial(logp_V.exp(), 1, generator=self.gen))
            ids.append(token)
            out.append(token)
            logprobs.append(float(logp_V[token]))
            if token == self.eos:
                break
        routed = None
        if return_routed_experts:  # every token that was an input: prompt + completion minus the last
            rows_TLK = self.model(torch.tensor([ids[:-1]]), return_routing=True).routed_experts[0]
            routed = RoutedExperts.from_array(
                rows_TLK[routed_experts_start:].numpy().astype(np.uint8), start=routed_experts_start
            )
        finish = "stop" if out[-1] == self.eos else "length"
        return GenerateResponse(
            token_ids=out,
            logprobs=logprobs,
            policy_versions=[self.version] * len(out),
            finish_reason=finish,
            routed_experts=routed,
        )


class ChattyEnv(Environment):
    """Three turns: the env answers every model turn with a short user message."""

    name = "chatty"
    max_turns = 3
    rubric = Rubric(rewards=(Reward(name="len", fn=lambda s: float(len(s.final_text))),))

    def task(self, split, index):
        return Task(id=f"chatty/{index}", prompt=[{"role": "user", "content": "hi"}])

    def reference(self, task):
        return []

    async def respond(self, state, text):
        return [{"role": "user", "content": f"turn {state.num_turns} ok"}]


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(preset_args("tiny-moe"))
    model.init_weights(seed=0)
    return model.eval()


@torch.no_grad()
def _recomputed_logprobs(model: Transformer, sample, temperature: float) -> np.ndarray:
    ids_1T = torch.tensor(sample.token_ids[None].astype(np.int64))
    replay_1TLK = torch.tensor(sample.routed_experts[None].astype(np.int64))
    logits_TV = model(ids_1T, routed_experts=replay_1TLK).logits[0].float() / temperature
    logp_TV = torch.log_softmax(logits_TV, dim=-1)
    # The token at t was sampled from the distribution at t - 1.
    return logp_TV[:-1].gather(1, ids_1T[0, 1:, None])[:, 0].numpy()


@pytest.mark.parametrize(
    ("env_name", "stitching"), [("reverse-text", "strict"), ("chatty", "strict"), ("chatty", "bridge")]
)
def test_stitched_samples_reproduce_sampler_logprobs(model, tokenizer, env_name, stitching):
    env = ChattyEnv() if env_name == "chatty" else build_env("reverse-text")
    task = env.task("train", 0)
    cfg = EnvConfig(name=env_name, max_tokens_per_turn=12, stitching=stitching)
    client = TinyModelClient(model, eos=tokenizer.eos_token_id, seed=1, version=4)
    sampling = SamplingParams(temperature=0.8, max_tokens=12)
    policy = TokenPolicy(client, tokenizer, sampling, config=cfg, return_routed_experts=True)
    ep = asyncio.run(run_episode(env, task, policy, config=cfg, episode_id="tiny"))

    assert ep.error is None and ep.metrics["num_turns"] == env.max_turns
    assert sum(int(s.loss_mask.sum()) for s in ep.samples) == ep.metrics["num_completion_tokens"]
    assert len(ep.samples) == ep.metrics["num_resets"] + 1  # random bytes may not re-encode: counted
    if stitching == "bridge":  # the sampled ids stay in the context: one sample for the whole episode
        assert ep.metrics["num_resets"] == 0 and len(ep.samples) == 1
    for sample in ep.samples:
        assert sample.routed_experts.shape == (sample.num_tokens, 4, 2)
        assert (sample.policy_versions[sample.loss_mask] == 4).all()
        recomputed = _recomputed_logprobs(model, sample, sampling.temperature)
        mask = sample.loss_mask[1:]
        np.testing.assert_allclose(recomputed[mask], sample.inference_logprobs[1:][mask], atol=2e-5)
