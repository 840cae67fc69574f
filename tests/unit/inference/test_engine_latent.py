"""The engine's MLA decode on the latent cache (projections absorbed) and its DSA attention over
selected keys only: the same generations as the expanded, dense-masked paths, across batches,
prefix-cache hits and weight updates; and the KV memory it reports."""

from __future__ import annotations

import copy
import logging
from dataclasses import replace

import pytest
import torch
from inference_helpers import Result, drain, random_prompts

from asyncrl.config.inference import InferenceConfig
from asyncrl.inference import Engine, SamplingOptions
from asyncrl.inference.kv_cache import AttentionPaths
from asyncrl.inference.metrics import render_metrics
from asyncrl.model import Transformer, preset_args
from asyncrl.model.compute import set_cpu_upcast

PRESETS = {
    "tiny-dsv3": preset_args("tiny-dsv3"),
    "tiny-glm5": replace(
        preset_args("tiny-glm5"), index_topk=8, indexer_types=("full", "shared", "full", "full")
    ),
}
EXPANDED_DENSE = AttentionPaths(latent_decode=False, sparse=False)  # how the engine first computed it


@pytest.fixture(scope="module", params=list(PRESETS))
def model(request) -> Transformer:
    m = Transformer(PRESETS[request.param])
    m.init_weights(seed=3, std=0.08)
    return m.eval()


def _engine(model: Transformer, paths: AttentionPaths | None = None, **overrides) -> Engine:
    cfg = {"model": "unused", "block_size": 4, "kv_cache_tokens": 4096, "max_num_batched_tokens": 24}
    return Engine(copy.deepcopy(model), InferenceConfig(**(cfg | overrides)), attention_paths=paths)


def _serve(engine: Engine, prompts: list[list[int]], salt: str | None = None) -> dict[str, Result]:
    for i, p in enumerate(prompts):
        opts = SamplingOptions(temperature=0.0 if i % 2 else 0.9, max_tokens=12, ignore_eos=True, seed=i)
        engine.add_request(f"r{i}", p, opts, cache_salt=salt)
    return drain(engine)


@pytest.mark.parametrize(
    "paths", [AttentionPaths(), AttentionPaths(sparse=False), AttentionPaths(latent_decode=False)]
)
def test_latent_and_sparse_paths_generate_as_the_expanded_dense_engine(model, paths):
    """A busy batch (prefills chunked by the 24-token budget, decodes batched, contexts past
    index_topk) and then prefix-cache hits: fp32 tokens equal, logprobs within 1e-5."""
    if not model.args.uses_dsa and not paths.sparse:
        pytest.skip("the same paths as the default without DSA")
    prompts = random_prompts([5, 30, 13, 21], seed=1)
    engines = {"want": _engine(model, EXPANDED_DENSE), "got": _engine(model, paths)}
    for salt in ("a", "a"):  # the second round hits the prefix cache
        out = {name: _serve(engine, prompts, salt) for name, engine in engines.items()}
        for rid, want in out["want"].items():
            got = out["got"][rid]
            assert got.tokens == want.tokens, rid
            assert (torch.tensor(got.logprobs) - torch.tensor(want.logprobs)).abs().max() <= 1e-5, rid
    assert engines["got"].stats()["prefix_cache_hits"] > 0


@pytest.fixture
def bf16_cpu_upcast():
    """bf16 weights on the CPU path that keeps fp32 copies of weights between steps."""
    set_cpu_upcast(True)
    yield
    set_cpu_upcast(None)


def test_absorbed_decode_follows_a_weight_update(model, bf16_cpu_upcast):
    """The absorbed projections are read from kv_b_proj at each step (its fp32 copy is dropped at
    the swap), so after an update the engine answers as a fresh engine on the new weights."""
    base = copy.deepcopy(model).bfloat16()
    new = copy.deepcopy(base)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=gen).to(p.dtype) * 0.05)
    (prompt,) = random_prompts([20], seed=2)
    engine = _engine(base)
    before = _serve(engine, [prompt, prompt])
    engine.load_weights({n: t.detach().clone() for n, t in new.state_dict().items()}, version=1)
    after = _serve(engine, [prompt, prompt])
    fresh = _serve(_engine(new), [prompt, prompt])
    assert after["r1"].tokens == fresh["r1"].tokens and after["r1"].logprobs == fresh["r1"].logprobs
    assert before["r1"].logprobs != fresh["r1"].logprobs, "the new weights must answer differently"


def test_engine_reports_kv_bytes_per_token_and_capacity(model, caplog):
    args = model.args
    with caplog.at_level(logging.INFO, logger="asyncrl.inference.engine"):
        engine = _engine(model, kv_cache_tokens=1000, max_model_len=512)
    latent = args.num_hidden_layers * (args.kv_lora_rank + args.qk_rope_head_dim) * 4  # fp32
    index_keys = args.num_hidden_layers * args.index_head_dim * 4 if args.uses_dsa else 0
    routing = args.num_hidden_layers * args.routing_top_k * 2  # int16
    per_token = latent + index_keys + routing
    assert engine.cache.bytes_per_token() == {"latent": latent, "routing": routing} | (
        {"index_keys": index_keys} if index_keys else {}
    )
    stats = engine.stats()
    assert stats["kv_bytes_per_token"] == per_token and stats["kv_cache_tokens"] == 1000
    assert engine.cache.nbytes() == per_token * 1000
    assert f"KV cache: {per_token} bytes per token" in caplog.text and "x 1000 tokens" in caplog.text
    text = render_metrics(stats | {"step_errors": 0}, paused=False)
    assert f"asyncrl_kv_bytes_per_token {per_token}" in text and "asyncrl_kv_cache_tokens 1000" in text


def test_kv_bytes_per_token_of_a_gqa_model():
    args = preset_args("tiny-moe")
    engine = _engine(Transformer(args), kv_cache_tokens=64, max_model_len=64)
    kv = args.num_hidden_layers * 2 * args.num_key_value_heads * args.head_dim * 4
    assert engine.cache.bytes_per_token() == {"kv": kv, "routing": args.num_hidden_layers * 2 * 2}
