"""fp32 exactness: engine logprobs equal a teacher-forced forward; greedy equals step-by-step greedy."""

import torch
from inference_helpers import drain, greedy_reference, random_prompts, teacher_logprobs

from asyncrl.inference import SamplingOptions


def _busy_batch(engine, prompts, greedy_every=2):
    """Mixed greedy / sampled requests with mixed lengths, all submitted together."""
    opts = []
    for i, p in enumerate(prompts):
        temp = 0.0 if i % greedy_every == 0 else [1.0, 0.7, 1.3][i % 3]
        o = SamplingOptions(
            temperature=temp,
            top_p=0.9 if i % 3 == 1 else 1.0,
            max_tokens=6 + 5 * (i % 4),
            ignore_eos=True,
            seed=i,
        )
        engine.add_request(f"r{i}", p, o, return_routed_experts=True)
        opts.append(o)
    return opts, drain(engine)


def test_greedy_alone_matches_stepwise_model(make_engine, tiny_moe):
    (prompt,) = random_prompts([11])
    engine = make_engine()
    engine.add_request("a", prompt, SamplingOptions(temperature=0.0, max_tokens=20, ignore_eos=True))
    res = drain(engine)["a"]
    assert res.tokens == greedy_reference(tiny_moe, prompt, 20)
    assert res.final.finish_reason == "length"


def test_busy_batch_greedy_and_logprobs_match_model(make_engine, tiny_moe):
    # block_size 4 and a 24-token step budget force paging, chunked prefill and mixed prefill/decode steps.
    engine = make_engine(max_num_batched_tokens=24, max_num_seqs=5)
    prompts = random_prompts([5, 37, 13, 3, 29, 8, 50, 17], seed=1)
    opts, results = _busy_batch(engine, prompts)
    for i, (p, o) in enumerate(zip(prompts, opts)):
        r = results[f"r{i}"]
        assert len(r.tokens) == o.max_tokens
        if o.greedy:
            assert r.tokens == greedy_reference(tiny_moe, p, o.max_tokens), f"request {i}"
        ref = teacher_logprobs(tiny_moe, p, r.tokens, o.temperature)
        assert (ref - torch.tensor(r.logprobs)).abs().max() <= 1e-5, f"request {i}"
    assert engine.stats()["kv_blocks_used"] == 0


def test_routing_replay_reproduces_logprobs(make_engine, tiny_moe):
    engine = make_engine(max_num_batched_tokens=16)
    prompts = random_prompts([9, 21, 6], seed=2)
    opts, results = _busy_batch(engine, prompts, greedy_every=3)
    args = tiny_moe.args
    for i, (p, o) in enumerate(zip(prompts, opts)):
        r = results[f"r{i}"]
        routing = r.final.routed_experts
        assert routing.dtype.name == "uint8"
        assert routing.shape == (len(p) + len(r.tokens), args.num_hidden_layers, args.num_experts_per_tok)
        replay = torch.from_numpy(routing.astype("int64"))[None]
        ref = teacher_logprobs(tiny_moe, p, r.tokens, o.temperature, routed_experts=replay)
        assert (ref - torch.tensor(r.logprobs)).abs().max() <= 1e-5
        with torch.no_grad():
            own = tiny_moe(torch.tensor([p + r.tokens]), return_routing=True).routed_experts[0]
        assert (own == replay[0]).float().mean() > 0.99


def test_preemption_recomputes_and_never_truncates(make_engine, tiny_moe):
    # 64-token pool for five 40-token sequences: sequences must be preempted and recomputed.
    engine = make_engine(kv_cache_tokens=64, max_model_len=64, max_num_batched_tokens=32)
    prompts = random_prompts([10, 12, 8, 14, 9], seed=3)
    for i, p in enumerate(prompts):
        engine.add_request(
            f"r{i}", p, SamplingOptions(temperature=1.0, max_tokens=30, ignore_eos=True, seed=i)
        )
    results = drain(engine)
    assert engine.stats()["preemptions"] > 0
    for i, p in enumerate(prompts):
        r = results[f"r{i}"]
        assert len(r.tokens) == 30 and r.final.finish_reason == "length"
        ref = teacher_logprobs(tiny_moe, p, r.tokens, 1.0)
        assert (ref - torch.tensor(r.logprobs)).abs().max() <= 1e-5


def test_seeded_requests_reproduce_across_batches(make_engine):
    (prompt,) = random_prompts([7], seed=4)
    opts = SamplingOptions(temperature=1.0, max_tokens=12, seed=123, ignore_eos=True)
    alone = make_engine()
    alone.add_request("x", prompt, opts)
    busy = make_engine()
    for i, p in enumerate(random_prompts([5, 30, 12], seed=5)):
        busy.add_request(f"o{i}", p, SamplingOptions(max_tokens=9, ignore_eos=True))
    busy.add_request("x", prompt, opts)
    assert drain(alone)["x"].tokens == drain(busy)["x"].tokens
