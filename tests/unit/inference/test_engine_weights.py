"""Weight updates between steps: versions stamped per token; later tokens use the new weights."""

import copy

import torch
from inference_helpers import Result, drain, random_prompts, teacher_logprobs

from asyncrl.inference import SamplingOptions
from asyncrl.model import save_pretrained


def _head_perturbed(model, seed=0):
    """A new policy that differs only in the LM head: the kept KV cache stays exact under it."""
    new = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        new.lm_head.weight.add_(torch.randn(new.lm_head.weight.shape, generator=g) * 0.2)
    return new


def test_keep_mode_update_mid_generation(make_engine, tiny_moe):
    engine = make_engine()
    prompts = random_prompts([9, 14], seed=20)
    opts = SamplingOptions(temperature=1.0, max_tokens=16, ignore_eos=True, seed=5)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, opts)
    results = {}
    for _ in range(6):
        for out in engine.step():
            results.setdefault(out.request_id, []).append(out)
    new_model = _head_perturbed(tiny_moe)
    engine.load_weights(dict(new_model.named_parameters()), version=7)
    merged = {rid: Result() for rid in results}
    for rid, outs in results.items():
        for o in outs:
            merged[rid].add(o)
    drain(engine, merged)
    for i, p in enumerate(prompts):
        r = merged[f"r{i}"]
        n_old = r.versions.count(0)
        assert 0 < n_old < 16 and r.versions == [0] * n_old + [7] * (16 - n_old)
        lp = torch.tensor(r.logprobs)
        old_ref = teacher_logprobs(tiny_moe, p, r.tokens, 1.0)
        new_ref = teacher_logprobs(new_model, p, r.tokens, 1.0)
        assert (old_ref[:n_old] - lp[:n_old]).abs().max() <= 1e-5
        assert (new_ref[n_old:] - lp[n_old:]).abs().max() <= 1e-5
        assert (old_ref[n_old:] - lp[n_old:]).abs().max() > 1e-2, "the update must change logprobs"


def test_abort_all_finishes_requests_with_abort(make_engine):
    engine = make_engine()
    for i, p in enumerate(random_prompts([5, 8], seed=21)):
        engine.add_request(
            f"r{i}", p, SamplingOptions(max_tokens=50, ignore_eos=True), return_routed_experts=True
        )
    for _ in range(3):
        engine.step()
    outs = engine.abort_all()
    assert sorted(o.request_id for o in outs) == ["r0", "r1"]
    assert all(o.finish_reason == "abort" for o in outs)
    assert not engine.has_unfinished() and engine.stats()["kv_blocks_used"] == 0


def test_read_weights_roundtrip(tmp_path, make_engine, tiny_moe):
    new_model = _head_perturbed(tiny_moe, seed=1)
    save_pretrained(new_model, tmp_path)
    engine = make_engine()
    engine.load_weights(engine.read_weights(str(tmp_path)), version=1)
    assert torch.equal(engine.model.lm_head.weight, new_model.lm_head.weight)
    assert engine.version == 1
