"""Weight updates between steps: versions stamped per token; later tokens use the new weights on top
of the KV the old weights computed (keep mode: running requests are not recomputed)."""

import copy

import pytest
import torch
from inference_helpers import Result, drain, random_prompts, teacher_logprobs

from asyncrl.inference import SamplingOptions
from asyncrl.model import Transformer, save_pretrained
from asyncrl.model.compute import set_cpu_packing, set_cpu_upcast
from weight_update_reference import kept_kv_logprobs, perturb_all_weights


class FedTokens:
    """Counts the tokens the engine feeds through its model (prefill + decode), across weight swaps."""

    def __init__(self) -> None:
        self.count, self.hooked = 0, []

    def watch(self, engine) -> None:
        if not any(m is engine.model for m in self.hooked):
            self.hooked.append(engine.model)
            engine.model.model.embed_tokens.register_forward_hook(self._add)

    def _add(self, module, args, output) -> None:
        self.count += args[0].numel()


def test_keep_mode_update_mid_generation(make_engine, tiny_moe):
    engine = make_engine()
    fed = FedTokens()
    fed.watch(engine)
    prompts = random_prompts([9, 14], seed=20)
    opts = SamplingOptions(temperature=1.0, max_tokens=16, ignore_eos=True, seed=5)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, opts)
    results = {}
    for _ in range(6):
        for out in engine.step():
            results.setdefault(out.request_id, []).append(out)
    new_model = perturb_all_weights(tiny_moe, seed=0, scale=0.2)
    engine.load_weights(dict(new_model.named_parameters()), version=7)
    fed.watch(engine)
    merged = {rid: Result() for rid in results}
    for rid, outs in results.items():
        for o in outs:
            merged[rid].add(o)
    drain(engine, merged)
    for i, p in enumerate(prompts):
        r = merged[f"r{i}"]
        n_old = r.versions.count(0)
        assert 1 < n_old < 16 and r.versions == [0] * n_old + [7] * (16 - n_old)
        lp = torch.tensor(r.logprobs)
        old_ref = teacher_logprobs(tiny_moe, p, r.tokens, 1.0)
        kept_ref = kept_kv_logprobs(tiny_moe, new_model, p, r.tokens, n_old, 1.0)
        scratch_ref = teacher_logprobs(new_model, p, r.tokens, 1.0)  # a re-prefill under the new weights
        assert (old_ref[:n_old] - lp[:n_old]).abs().max() <= 1e-5
        assert (kept_ref - lp[n_old:]).abs().max() <= 1e-5, "later tokens: new weights over the kept KV"
        assert (scratch_ref[n_old:] - lp[n_old:]).abs().max() > 1e-2, "the old KV must matter"
        assert (old_ref[n_old:] - lp[n_old:]).abs().max() > 1e-2, "the update must change logprobs"
    # Every prompt token and every sampled token but the last went through the model exactly once:
    # recomputing a running request after the update would feed its prefix again.
    assert fed.count == sum(len(p) + 16 - 1 for p in prompts)


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
    new_model = perturb_all_weights(tiny_moe, seed=1, scale=0.2)
    save_pretrained(new_model, tmp_path)
    engine = make_engine()
    state = engine.read_weights(str(tmp_path))
    engine.load_weights(state, version=1)
    # the swap between two steps is a pointer swap (the pause an update costs), not a copy
    assert all(p.data_ptr() == state[k].data_ptr() for k, p in engine.model.named_parameters())
    want = dict(new_model.named_parameters())
    got = dict(engine.model.named_parameters())
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want), "every weight, not only the LM head"
    assert not torch.equal(got["model.embed_tokens.weight"], tiny_moe.model.embed_tokens.weight)
    assert engine.version == 1


def _state_refs(model: Transformer) -> dict[str, torch.Tensor]:
    """Every tensor a weight update fills (a tied LM head once, as the embedding)."""
    return dict(model.named_parameters()) | dict(model.named_buffers())


def _state(model: Transformer) -> dict[str, torch.Tensor]:
    """A fresh copy of every tensor a weight update fills."""
    return {name: t.detach().clone() for name, t in _state_refs(model).items()}


@pytest.fixture(params=["fp32 copies", "packed weights"])
def kept_copy_path(request):
    """A CPU path that keeps a copy derived from each weight between steps: the dtype to serve in.
    bf16 weights with an fp32 copy of each, or fp32 weights with oneDNN's packed copy of each (as
    for large weights)."""
    if request.param == "fp32 copies":
        set_cpu_upcast(True)
    else:
        set_cpu_packing(True)
    yield torch.bfloat16 if request.param == "fp32 copies" else torch.float32
    set_cpu_upcast(None)
    set_cpu_packing(None)


def _greedy(engine, prompt: list[int]) -> Result:
    engine.add_request("r", prompt, SamplingOptions(temperature=0, max_tokens=6, ignore_eos=True))
    return drain(engine)["r"]


def test_two_swaps_without_a_step_serve_the_last_weights(make_engine, tiny_moe, kept_copy_path):
    base = copy.deepcopy(tiny_moe).to(kept_copy_path)
    w1, w2 = (perturb_all_weights(base, seed=s, scale=0.2) for s in (30, 31))
    engine = make_engine(base)
    prompt = random_prompts([12], seed=22)[0]
    base_out = _greedy(engine, prompt)  # the engine now keeps copies made from the base weights
    # Two updates in a row, no step between them (an idle server). The second one's tensors sit at
    # the addresses of the base weights, as a reader alternating two sets of buffers places them
    # (and as the allocator often does: 9 of 10 fresh trials); `.data` aliases write them without
    # touching the weights' version counters, so nothing but the swap itself marks the change.
    buffers = {name: t.data for name, t in _state_refs(engine.model).items()}
    engine.load_weights(_state(w1), version=1)
    with torch.no_grad():
        for name, t in _state(w2).items():
            buffers[name].copy_(t)
    engine.load_weights(buffers, version=2)
    got = _greedy(engine, prompt)
    want = _greedy(make_engine(w2), prompt)
    assert got.versions == [2] * 6
    assert got.tokens == want.tokens and got.logprobs == want.logprobs
    assert base_out.logprobs != want.logprobs, "the base weights must answer differently"
