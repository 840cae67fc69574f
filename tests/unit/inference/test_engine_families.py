"""The engine serves DeepSeek-V3 / GLM-5 (MLA latent KV cache, DSA indexer keys cached alongside)
and GLM-4.5: fp32 greedy equals transformers' greedy, logprobs equal a teacher-forced forward,
routing replays, and prefix-cache hits give the same answers."""

from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np
import pytest
import torch
from inference_helpers import drain, greedy_reference, random_prompts, teacher_logprobs
from transformers import AutoModelForCausalLM

from asyncrl.config.inference import InferenceConfig
from asyncrl.inference import Engine, SamplingOptions
from asyncrl.model import Transformer, preset_args, save_pretrained
from asyncrl.model.args import YarnScaling

# index_topk 8 so that the prompts below (up to 30 tokens) make the indexer choose. 16 index heads:
# an index score is an exact tie (all relu terms zero) with odds ~2^-16, so transformers' topk and
# our position-ordered tie rule pick the same keys (see docs/models/glm_moe_dsa.md).
_GLM5 = dict(index_topk=8, index_n_heads=16, indexer_types=("full", "shared", "full", "full"))
PRESETS = {
    "tiny-dsv3": preset_args("tiny-dsv3"),
    "tiny-glm5": replace(preset_args("tiny-glm5"), **_GLM5),
    "tiny-glm4moe": preset_args("tiny-glm4moe"),
}


@pytest.fixture(scope="module", params=list(PRESETS))
def model(request) -> Transformer:
    m = Transformer(PRESETS[request.param])
    m.init_weights(seed=3, std=0.08)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, buf in m.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.3)
    return m.eval()


def _engine(model: Transformer, **overrides) -> Engine:
    cfg = {
        "model": "unused",
        "block_size": 4,
        "kv_cache_tokens": 4096,
        "max_num_batched_tokens": 24,
    } | overrides
    return Engine(copy.deepcopy(model), InferenceConfig(**cfg))


def test_busy_batch_greedy_logprobs_and_routing_match_model(model):
    engine = _engine(model, max_num_seqs=4)
    prompts = random_prompts([5, 30, 13, 21], seed=1)
    opts = []
    for i, p in enumerate(prompts):
        o = SamplingOptions(
            temperature=0.0 if i % 2 == 0 else 0.8, max_tokens=8 + 3 * i, ignore_eos=True, seed=i
        )
        engine.add_request(f"r{i}", p, o, return_routed_experts=True)
        opts.append(o)
    results = drain(engine)
    for i, (p, o) in enumerate(zip(prompts, opts, strict=True)):
        r = results[f"r{i}"]
        if o.greedy:
            assert r.tokens == greedy_reference(model, p, o.max_tokens), f"request {i}"
        ref = teacher_logprobs(model, p, r.tokens, o.temperature)
        assert (ref - torch.tensor(r.logprobs)).abs().max() <= 1e-5, f"request {i}"
        replay = torch.from_numpy(r.final.routed_experts.astype("int64"))[None]
        assert replay.shape[1:] == (len(p) + len(r.tokens), 4, 2)
        assert torch.all(replay[0, :, 0] == 0)  # first_k_dense_replace = 1
        ref_replay = teacher_logprobs(model, p, r.tokens, o.temperature, routed_experts=replay)
        assert (ref_replay - torch.tensor(r.logprobs)).abs().max() <= 1e-5
    assert engine.stats()["kv_blocks_used"] == 0


def test_prefix_cache_hit_gives_same_tokens(model):
    engine = _engine(model)
    (prompt,) = random_prompts([22], seed=10)
    opts = SamplingOptions(temperature=0.0, max_tokens=6, ignore_eos=True)
    out = {}
    for rid in ("a", "b"):
        engine.add_request(rid, prompt, opts, cache_salt="v0", return_routed_experts=True)
        out[rid] = drain(engine)[rid]
    assert out["b"].final.num_cached_tokens == 20 and out["a"].tokens == out["b"].tokens
    np.testing.assert_array_equal(out["a"].final.routed_experts, out["b"].final.routed_experts)


def test_fp32_greedy_equals_transformers_greedy(model, tmp_path):
    save_pretrained(model, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    (prompt,) = random_prompts([17], seed=5)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None)
    engine = _engine(model)
    engine.add_request("a", prompt, SamplingOptions(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert drain(engine)["a"].tokens == ref[0, len(prompt) :].tolist()


def test_mla_cache_holds_latents_not_heads(model):
    args = model.args
    engine = _engine(model)
    if args.uses_mla:
        assert engine.cache.k_LPGd.numel() == 0
        per_token = args.kv_lora_rank + args.qk_rope_head_dim + (args.index_head_dim if args.uses_dsa else 0)
        expanded = args.num_attention_heads * (args.qk_head_dim + args.v_head_dim)
        assert engine.cache.latent_LPc.shape[-1] + engine.cache.index_k_LPd.shape[-1] == per_token < expanded
    else:
        assert engine.cache.latent_LPc.numel() == 0 and engine.cache.k_LPGd.shape[-1] == args.head_dim


def test_yarn_model_is_served_as_it_computes_and_as_transformers_generates(tmp_path):
    """YaRN (cos/sin factor and MLA softmax gain both on) past the original 8 positions: the engine
    takes its rope from the model, so logprobs equal a teacher-forced forward, and greedy equals
    transformers' greedy on the saved model."""
    yarn = YarnScaling(factor=4.0, original_max_position_embeddings=8, mscale=0.9, mscale_all_dim=0.6)
    model = Transformer(replace(preset_args("tiny-dsv3"), rope_scaling=yarn))
    model.init_weights(seed=5, std=0.08)
    model.eval()
    engine = _engine(model, max_num_seqs=2)
    prompts = random_prompts([20, 13], seed=2)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingOptions(temperature=0.0, max_tokens=12, ignore_eos=True))
    results = drain(engine)
    for i, p in enumerate(prompts):
        tokens = results[f"r{i}"].tokens
        ref = teacher_logprobs(model, p, tokens, 0.0)
        assert (ref - torch.tensor(results[f"r{i}"].logprobs)).abs().max() <= 1e-5
    save_pretrained(model, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompts[0]]), max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert results["r0"].tokens == ref[0, len(prompts[0]) :].tolist()
