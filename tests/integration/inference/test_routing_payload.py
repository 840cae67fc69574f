"""Router replay over the compact path: per-turn routing deltas over the binary body, stitched into a
sample, written to a batch and read back, are the engine's routing of the whole context, bit for bit.
"""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
import torch

from asyncrl.client import HttpBackend
from asyncrl.client.inference_client import RequestClient
from asyncrl.config import EnvConfig
from asyncrl.envs.policy import TokenPolicy
from asyncrl.model import from_pretrained
from asyncrl.transport.rollouts import read_batch, write_batch
from asyncrl.wire import GenerateRequest, GenerateResponse, RolloutBatch, SamplingParams
from asyncrl.wire.binary import GENERATE_MEDIA_TYPE

ENV_TOKENS = [list(range(40, 70)), list(range(100, 110)), list(range(200, 212))]  # what each turn adds


class _Ids:
    """A chat tokenizer whose messages carry their token ids, so turns extend the context exactly."""

    def render(self, messages, tools):
        return [t for m in messages for t in m["ids"]]

    def decode(self, ids):
        return ""


class _Recording(httpx.AsyncHTTPTransport):
    """Notes the content type of every answer."""

    def __init__(self) -> None:
        super().__init__()
        self.content_types: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        self.content_types.append(response.headers.get("content-type", ""))
        return response


@pytest.fixture(scope="module")
def episode(server):
    """A 3-turn episode through TokenPolicy over HttpBackend; then the whole context in one request."""
    requests, responses = [], []
    transport = _Recording()

    async def go():
        backend = HttpBackend(server.url, api_key=server.api_key, transport=transport)

        async def send(request: GenerateRequest) -> GenerateResponse:
            requests.append(request)
            responses.append(await backend.generate(request))
            return responses[-1]

        sampling = SamplingParams(max_tokens=6, temperature=1.0, seed=5, ignore_eos=True)
        policy = TokenPolicy(
            RequestClient(send),
            _Ids(),
            sampling,
            config=EnvConfig(name="calculator"),
            cache_salt="r3",
            return_routed_experts=True,
        )
        messages = []
        for env_ids in ENV_TOKENS:
            messages.append({"ids": env_ids})
            await policy.complete(messages, [])
            messages.append({"ids": responses[-1].token_ids})
        (sample,) = policy.build_samples(reward=1.0, env="calculator", episode_id="e0", metrics={})
        # the engine's routing of the whole context, computed afresh (another salt: no cached blocks)
        whole = await backend.generate(
            GenerateRequest(
                prompt_token_ids=sample.token_ids.tolist(),
                max_tokens=1,
                return_routed_experts=True,
                cache_salt="fresh",
            )
        )
        await backend.aclose()
        return sample, whole.routed_experts.to_array()

    sample, whole = asyncio.run(go())
    assert transport.content_types == [GENERATE_MEDIA_TYPE] * 4  # every answer came as the binary body
    return requests, responses, sample, whole


def test_per_turn_routing_deltas_assemble_into_the_whole_context_routing(episode, tmp_path):
    requests, responses, sample, whole = episode
    held = 0
    for request, response in zip(requests, responses):
        # each turn asks only for what it adds, and gets exactly that; the prompt does not come back
        assert response.prompt_token_ids is None
        assert request.routed_experts_start == held and response.routed_experts.start == held
        held = len(request.prompt_token_ids) + len(response.token_ids)
        assert response.routed_experts.shape[0] == held - request.routed_experts_start
    # the prompt rows a later turn gets are its new environment tokens only
    assert [len(r.prompt_token_ids) - r.routed_experts_start for r in requests] == [
        len(t) for t in ENV_TOKENS
    ]
    n = len(sample.token_ids)
    assert sample.routed_experts.dtype == whole.dtype == np.uint8
    assert sample.routed_experts.tobytes() == whole[:n].tobytes()
    write_batch(tmp_path, RolloutBatch(step=0, samples=[sample]))
    (back,) = read_batch(tmp_path, 0, timeout_s=5).samples
    assert back.routed_experts.dtype == np.uint8 and back.routed_experts.tobytes() == whole[:n].tobytes()


def test_replaying_routing_read_from_a_batch_reproduces_the_sampled_logprobs(server, episode, tmp_path):
    _, _, sample, _ = episode
    write_batch(tmp_path, RolloutBatch(step=0, samples=[sample]))
    (back,) = read_batch(tmp_path, 0, timeout_s=5).samples
    model = from_pretrained(server.model_dir)
    ids = torch.from_numpy(back.token_ids.astype(np.int64))[None]
    replay = torch.from_numpy(back.routed_experts.astype(np.int64))[None]
    with torch.no_grad():
        logits = model(ids, routed_experts=replay).logits[0, :-1]
    lp = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
    sampled = torch.from_numpy(back.loss_mask[1:])
    recorded = torch.from_numpy(back.inference_logprobs[1:])
    assert int(sampled.sum()) == 18
    assert (lp[sampled] - recorded[sampled]).abs().max() <= 1e-5
