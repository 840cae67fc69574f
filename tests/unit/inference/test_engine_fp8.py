"""FP8 inference: `[fp8] enabled` quantizes the engine's model, and its logprobs are those of the
same FP8 model in `asyncrl.model` (so a matched FP8 trainer sees no precision mismatch)."""

import copy
from dataclasses import replace

import pytest
import torch
from inference_helpers import drain, random_prompts, teacher_logprobs

from asyncrl.config.inference import InferenceConfig
from asyncrl.inference import Engine, SamplingOptions
from asyncrl.model import Transformer, from_pretrained, preset_args
from asyncrl.model.fp8 import FP8Linear, apply_fp8
from asyncrl.tools.init_model import init_model


def test_fp8_engine_matches_fp8_model_and_differs_from_fp32(tmp_path, tiny_moe):
    path = tmp_path / "m"
    init_model("tiny-moe", path, seed=5)
    engine = Engine.from_config(
        InferenceConfig(
            model=str(path), block_size=4, kv_cache_tokens=4096, fp8={"enabled": True, "backend": "emulated"}
        )
    )
    assert isinstance(engine.model.model.layers[0].self_attn.q_proj, FP8Linear)
    (prompt,) = random_prompts([12], seed=4)
    engine.add_request("a", prompt, SamplingOptions(temperature=1.0, max_tokens=10, ignore_eos=True, seed=1))
    res = drain(engine)["a"]
    fp8_model = from_pretrained(path)
    apply_fp8(fp8_model, backend="emulated")
    ref_fp8 = teacher_logprobs(fp8_model, prompt, res.tokens, 1.0)
    ref_fp32 = teacher_logprobs(from_pretrained(path), prompt, res.tokens, 1.0)
    got = torch.tensor(res.logprobs)
    assert (ref_fp8 - got).abs().max() <= 1e-5
    assert (ref_fp32 - got).abs().max() > 1e-4  # quantization is really on


def test_fp8_off_by_default(make_engine):
    engine = make_engine()
    assert not any(isinstance(m, FP8Linear) for m in engine.model.modules())
    assert copy.deepcopy(InferenceConfig(model="m")).fp8.enabled is False


@pytest.mark.parametrize("preset", ["tiny-dsv3", "tiny-glm5"])
def test_fp8_engine_on_mla_families_follows_the_fp8_model(preset):
    """FP8 MLA projections, experts and (GLM-5) the indexer's wq_b: the engine, which caches the
    latent and indexer keys, follows the same FP8 model run teacher-forced, past index_topk (8)
    where GLM-5's selection matters. Not to 1e-5 at every position: the engine's attention sums
    in another order than the full forward (~1e-7 apart in fp32), and where such a difference
    straddles an e4m3 rounding boundary the quantized operand moves a whole FP8 step, which
    later layers (and the latent cached for later tokens) carry on. With this seed that happens
    in both families."""
    args = replace(
        preset_args(preset),
        hidden_size=256,
        intermediate_size=256,
        head_dim=32,
        q_lora_rank=128,
        kv_lora_rank=128,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=32,
        moe_intermediate_size=128,
        **(dict(index_n_heads=16, index_head_dim=32, index_topk=8) if preset == "tiny-glm5" else {}),
    )
    hp = Transformer(args)
    hp.init_weights(seed=3, std=0.05)
    fp8 = copy.deepcopy(hp)
    report = apply_fp8(fp8, backend="emulated")
    assert "model.layers.1.self_attn.kv_b_proj" in report.converted
    # cpu_matmul_kernel off: its linears of few rows sum in another order than the full forward's
    cfg = InferenceConfig(model="unused", block_size=4, kv_cache_tokens=4096, cpu_matmul_kernel=False)
    engine = Engine(copy.deepcopy(fp8).eval(), cfg)
    (prompt,) = random_prompts([12], seed=4)
    engine.add_request("a", prompt, SamplingOptions(temperature=1.0, max_tokens=16, ignore_eos=True, seed=1))
    res = drain(engine)["a"]
    got = torch.tensor(res.logprobs)
    to_fp8 = (teacher_logprobs(fp8.eval(), prompt, res.tokens, 1.0) - got).abs()
    to_hp = (teacher_logprobs(hp.eval(), prompt, res.tokens, 1.0) - got).abs()
    assert to_fp8[0] < 1e-5  # the first token comes from the prefill, computed as in the full forward
    assert to_fp8.mean() < to_hp.mean() / 10
