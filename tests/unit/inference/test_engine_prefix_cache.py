"""Automatic prefix caching: hits under the same salt, none under another, routing kept with blocks."""

import numpy as np
import torch
from inference_helpers import Result, drain, random_prompts, teacher_logprobs

from asyncrl.inference import SamplingOptions

GREEDY = SamplingOptions(temperature=0.0, max_tokens=6, ignore_eos=True)


def _run(engine, rid, prompt, salt, opts=GREEDY):
    engine.add_request(rid, prompt, opts, cache_salt=salt, return_routed_experts=True)
    return drain(engine)[rid]


def test_repeated_prompt_hits_cache_other_salt_misses(make_engine, tiny_moe):
    engine = make_engine()  # block_size 4
    (prompt,) = random_prompts([22], seed=10)
    first = _run(engine, "a", prompt, "v0")
    again = _run(engine, "b", prompt, "v0")
    other = _run(engine, "c", prompt, "v1")
    assert first.final.num_cached_tokens == 0
    assert again.final.num_cached_tokens == 20  # every full block before the last prompt token
    assert other.final.num_cached_tokens == 0
    assert again.tokens == first.tokens == other.tokens
    ref = teacher_logprobs(tiny_moe, prompt, again.tokens, 1.0)
    assert (ref - torch.tensor(again.logprobs)).abs().max() <= 1e-5
    # Cached tokens still report the routing they were computed with.
    np.testing.assert_array_equal(again.final.routed_experts, first.final.routed_experts)
    assert engine.stats()["prefix_cache_hits"] == 5


def test_shared_prefix_with_different_suffix_and_routing_start(make_engine, tiny_moe):
    engine = make_engine()
    base, tail_a, tail_b = random_prompts([16, 5, 7], seed=11)
    a = _run(engine, "a", base + tail_a, None)
    engine.add_request("b", base + tail_b, GREEDY, return_routed_experts=True, routed_experts_start=10)
    b = drain(engine)["b"]
    assert b.final.num_cached_tokens == 16
    assert b.final.routed_experts.shape[0] == len(base + tail_b) + len(b.tokens) - 10
    np.testing.assert_array_equal(b.final.routed_experts[:6], a.final.routed_experts[10:16])
    ref = teacher_logprobs(tiny_moe, base + tail_b, b.tokens, 1.0)
    assert (ref - torch.tensor(b.logprobs)).abs().max() <= 1e-5


def test_lru_eviction_keeps_engine_correct(make_engine, tiny_moe):
    # A 48-token pool forces cached blocks of earlier prompts to be evicted and reused.
    engine = make_engine(kv_cache_tokens=48, max_model_len=48)
    prompts = random_prompts([20, 20, 20, 20], seed=12)
    for i, p in enumerate(prompts + prompts[:1]):
        r = _run(engine, f"r{i}", p, None)
        ref = teacher_logprobs(tiny_moe, p, r.tokens, 1.0)
        assert (ref - torch.tensor(r.logprobs)).abs().max() <= 1e-5
    assert r.final.num_cached_tokens == 0  # the first prompt's blocks were evicted


def test_no_kv_of_old_weights_after_a_weight_load_even_unsalted(make_engine, tiny_moe):
    """A request running across the update keeps its blocks; requests admitted after it never hit them."""
    engine = make_engine()
    (prompt,) = random_prompts([22], seed=13)
    long = SamplingOptions(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine.add_request("running", prompt, long)
    results = {}
    for out in engine.step():  # "running" has prefilled: its prompt blocks are in the cache
        results.setdefault(out.request_id, Result()).add(out)
    engine.load_weights({k: v.clone() for k, v in tiny_moe.state_dict().items()}, version=1)
    engine.add_request("after", prompt, GREEDY)  # no salt, like eval or the OpenAI API
    drain(engine, results)
    assert results["after"].final.num_cached_tokens == 0
    running = results["running"]  # kept its own (old-weights) KV and finished under v1
    assert len(running.tokens) == 40 and running.versions[0] == 0 and set(running.versions[1:]) == {1}
    again = _run(engine, "again", prompt, None)  # within one weights epoch the cache still works
    assert again.final.num_cached_tokens == 20
