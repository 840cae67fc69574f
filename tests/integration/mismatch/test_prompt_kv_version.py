"""A prompt prefilled in chunks across a weight update is stale KV: its tokens never count as "current".

The embedded engine (fp32) prefills 16 of a 40-token prompt under v0, loads v1, and samples every
token under v1. Its response reports `context_version` 0; the trajectory records it per token, the
trainer's packing folds it into the context versions, and the mismatch split and gate then count
those tokens as stale. A request admitted after the update is the clean control: current, and on
policy (fp32 engine, fp32 trainer, replayed routing).
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from asyncrl.config.inference import InferenceConfig
from asyncrl.envs import TrajectoryBuilder
from asyncrl.inference.engine import Engine
from asyncrl.inference.request import RequestOutput, SamplingOptions
from asyncrl.model import Transformer, preset_args
from asyncrl.trainer.logprobs import chunked_logprobs
from asyncrl.trainer.mismatch import check_mismatch_gate, mismatch_by_staleness
from asyncrl.trainer.packing import build_micro_batch
from asyncrl.wire import GenerateResponse, RolloutSample, RoutedExperts
from weight_update_reference import perturb_all_weights

OPTS = SamplingOptions(temperature=1.0, max_tokens=8, ignore_eos=True, seed=7)


def _response(outs: list[RequestOutput], prompt: list[int]) -> GenerateResponse:
    """What `/v1/generate` answers for these engine outputs."""
    final = outs[-1]
    return GenerateResponse(
        token_ids=[t for o in outs for t in o.new_token_ids],
        logprobs=[x for o in outs for x in o.new_logprobs],
        policy_versions=[v for o in outs for v in o.new_versions],
        finish_reason=final.finish_reason.value,
        prompt_token_ids=prompt,
        routed_experts=RoutedExperts.from_array(np.asarray(final.routed_experts)),
        context_version=final.context_version,
    )


def _sample(response: GenerateResponse, prompt: list[int]) -> RolloutSample:
    traj = TrajectoryBuilder()
    traj.extend_prompt(prompt, temperature=OPTS.temperature)
    traj.add_completion(response, temperature=OPTS.temperature)
    (sample,) = traj.build(reward=0.0, env="e", episode_id="ep", metrics={})
    return sample


def test_prompt_prefilled_across_an_update_is_stale_for_the_trainer():
    v0 = Transformer(preset_args("tiny-moe"))
    v0.init_weights(seed=11, std=0.05)
    v1 = perturb_all_weights(v0, seed=12, scale=0.2)
    cfg = InferenceConfig(
        model="unused", block_size=4, kv_cache_tokens=512, max_model_len=128, max_num_batched_tokens=16
    )
    engine = Engine(copy.deepcopy(v0), cfg)
    gen = torch.Generator().manual_seed(3)
    prompts = {rid: torch.randint(0, 256, (40,), generator=gen).tolist() for rid in ("spans", "clean")}
    outs: dict[str, list[RequestOutput]] = {"spans": [], "clean": []}
    engine.add_request("spans", prompts["spans"], OPTS, return_routed_experts=True)
    assert engine.step() == []  # 16 prompt tokens under v0, nothing sampled
    engine.load_weights({k: v.detach().clone() for k, v in v1.state_dict().items()}, version=1)
    engine.add_request("clean", prompts["clean"], OPTS, return_routed_experts=True)
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].append(out)
    responses = {rid: _response(o, prompts[rid]) for rid, o in outs.items()}
    assert responses["spans"].policy_versions == [1] * 8 and responses["spans"].context_version == 0
    assert responses["clean"].policy_versions == [1] * 8 and responses["clean"].context_version == 1

    mb = build_micro_batch([_sample(responses[rid], prompts[rid]) for rid in ("spans", "clean")], replay=True)
    spans_T = mb.loss_mask & (mb.seq_ids == 0)
    assert mb.context_versions[spans_T].tolist() == [0] * 8
    assert mb.context_versions[mb.loss_mask & (mb.seq_ids == 1)].tolist() == [1] * 8
    with torch.no_grad():  # the trainer at step 2 scores with v1
        hidden = v1(mb.input_ids, mb.position_ids, routed_experts=mb.routed_experts, compute_logits=False)
        lp, _ = chunked_logprobs(
            hidden.hidden_states[0], v1.lm_head.weight, mb.target_ids, mb.temperatures, 16
        )
    split = mismatch_by_staleness(
        lp, mb.inference_logprobs, mb.loss_mask, mb.context_versions, trainer_version=1
    )
    current, stale = split["current"].metrics(), split["stale"].metrics()
    assert current["mismatch_tokens"] == 8 and stale["mismatch_tokens"] == 8
    assert current["mismatch_kl"] < 1e-6, "the clean request is on policy"
    assert stale["mismatch_kl"] > 1e-2, "the spanning one attended over v0's prompt KV"
    assert check_mismatch_gate(current["mismatch_kl"], max_kl=1e-3, mode="fail", step=2) is None
    # Split on the tokens' own versions instead, the spanning tokens would pass for current ones.
    by_stamp = mismatch_by_staleness(
        lp, mb.inference_logprobs, mb.loss_mask, mb.policy_versions, trainer_version=1
    )
    assert by_stamp["current"].num_tokens == 16 and by_stamp["current"].metrics()["mismatch_kl"] > 1e-3
