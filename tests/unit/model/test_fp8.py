"""FP8 block-scale quantization against a float64 reference, the FP8 linear, and apply_fp8."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from asyncrl.model import Transformer, preset_args
from asyncrl.model.fp8 import (
    AMAX_FLOOR,
    FP8_MAX,
    FP8Linear,
    NonFiniteInputError,
    apply_fp8,
    dequantize_activation,
    dequantize_weight,
    fp8_linear,
    quantize_activation,
    quantize_weight,
)
from asyncrl.model.layers import PackedCausalAttention

# Every finite float8_e4m3fn value, in float64: the grid a float64 reference rounds onto.
_BITS = torch.arange(256, dtype=torch.int32).to(torch.uint8)
_ALL = _BITS.view(torch.float8_e4m3fn).double()
GRID = torch.unique(_ALL[torch.isfinite(_ALL)])


def round_e4m3_f64(v: torch.Tensor) -> torch.Tensor:
    """Nearest e4m3 grid value (ties to the even mantissa code), in float64, saturating at 448."""
    v = v.double().clamp(-FP8_MAX, FP8_MAX)
    idx = torch.searchsorted(GRID, v).clamp(1, len(GRID) - 1)
    lo, hi = GRID[idx - 1], GRID[idx]
    pick_hi = (hi - v) < (v - lo)
    tie = (hi - v) == (v - lo)
    codes_hi = hi.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int32)
    pick_hi |= tie & (codes_hi % 2 == 0)
    return torch.where(pick_hi, hi, lo)


def reference_quant_dequant(x_f64: torch.Tensor, group_shape: tuple[int, int]) -> torch.Tensor:
    """float64 block quantize -> dequantize with groups of group_shape over a 2-D tensor."""
    R, C = x_f64.shape
    gr, gc = group_shape
    blocks = x_f64.view(R // gr, gr, C // gc, gc)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(min=AMAX_FLOOR)
    scale = amax / FP8_MAX
    return (round_e4m3_f64(blocks / scale) * scale).view(R, C)


def spread_input(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random values whose magnitude varies by orders of magnitude between 128-wide groups."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen)
    mags = 10.0 ** torch.randint(-4, 5, (rows, cols // 128), generator=gen).float()
    return x * mags.repeat_interleave(128, dim=1)


def test_activation_quantization_matches_float64_reference():
    x = spread_input(9, 384, seed=0)
    q, scale = quantize_activation(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (9, 3)
    got = dequantize_activation(q, scale).double()
    want = reference_quant_dequant(x.double(), (1, 128))
    rel = (got - want).abs() / want.abs().clamp(min=1e-30)
    assert float(rel.max()) < 1e-6  # same e4m3 code everywhere; only the fp32 scale differs


def test_weight_quantization_matches_float64_reference():
    w = spread_input(256, 384, seed=1).T.contiguous()  # [384, 256]: 3 x 2 blocks, varied magnitudes
    q, scale = quantize_weight(w)
    assert scale.shape == (3, 2)
    got = dequantize_weight(q, scale).double()
    want = reference_quant_dequant(w.double(), (128, 128))
    rel = (got - want).abs() / want.abs().clamp(min=1e-30)
    assert float(rel.max()) < 1e-6


def test_block_boundaries_are_independent():
    x = torch.full((2, 256), 1e-3)
    x[:, 127] = 1e4  # last column of group 0: must not touch group 1 (starting at column 128)
    q, scale = quantize_activation(x)
    assert torch.allclose(scale[:, 0], torch.tensor(1e4 / FP8_MAX))
    assert torch.allclose(scale[:, 1], torch.tensor(1e-3 / FP8_MAX))
    dq = dequantize_activation(q, scale)
    assert torch.allclose(dq[:, 128:], x[:, 128:], rtol=1e-6)
    assert float(q[:, 127].float().abs().min()) == FP8_MAX  # the amax maps onto e4m3's largest value
    assert torch.equal(dq[:, :127], torch.zeros(2, 127))  # 1e-3 is far below 1e4's smallest step

    w = torch.full((256, 256), 0.5)
    w[0:128, 128:256] = 300.0  # block (0, 1) large; block (1, 0) must keep its own scale
    wq, ws = quantize_weight(w)
    assert torch.allclose(ws, torch.tensor([[0.5, 300.0], [0.5, 0.5]]) / FP8_MAX)
    assert torch.equal(dequantize_weight(wq, ws), w)  # both values are exact after block scaling


def test_zeros_and_extremes_round_trip_within_e4m3_error():
    x = spread_input(4, 256, seed=2)
    x[0] = 0.0  # all-zero groups: floor scale, exact zeros, no NaN
    x[1, :128] = 3e38  # close to the fp32 maximum
    x[2, 128:] = 1e-30  # tiny: below the floor, flushed to zero
    q, scale = quantize_activation(x)
    dq = dequantize_activation(q, scale)
    assert torch.isfinite(dq).all()
    assert torch.equal(dq[0], torch.zeros(256)) and float(scale[0, 0]) == pytest.approx(AMAX_FLOOR / FP8_MAX)
    assert torch.equal(dq[2, 128:], torch.zeros(128))
    # e4m3: 3 mantissa bits -> half-step relative error 2^-4 for normals, 2^-10 * scale for subnormals.
    bound = torch.maximum(x.abs() * 2**-4, scale.repeat_interleave(128, dim=1) * 2**-10) * (1 + 1e-5)
    assert bool(((dq - x).abs() <= bound).all())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_gives_clear_error(bad):
    x = torch.randn(3, 128)
    x[1, 5] = bad
    with pytest.raises(NonFiniteInputError, match="activation holds NaN or inf"):
        quantize_activation(x)
    w = torch.randn(128, 128)
    w[7, 9] = bad
    with pytest.raises(NonFiniteInputError, match="weight holds NaN or inf"):
        fp8_linear(torch.randn(2, 128), w)


def test_dims_not_multiple_of_128_rejected():
    with pytest.raises(ValueError, match="activation dim 96 is not a multiple of 128"):
        quantize_activation(torch.randn(2, 96))
    with pytest.raises(ValueError, match=r"weight shape \[64, 128\]"):
        quantize_weight(torch.randn(64, 128))


def test_fp8_linear_equals_float64_matmul_of_quantized_operands():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 256, generator=gen)
    w = torch.randn(384, 256, generator=gen) * 0.05
    b = torch.randn(384, generator=gen)
    y = fp8_linear(x, w, b, backend="emulated")
    x_dq = reference_quant_dequant(x.reshape(10, 256).double(), (1, 128))
    w_dq = reference_quant_dequant(w.double(), (128, 128))
    want = (x_dq @ w_dq.T + b.double()).view(2, 5, 384)
    assert torch.allclose(y.double(), want, rtol=1e-5, atol=1e-5)
    # and it is a faithful low-precision version of the exact product: a few percent off
    exact = F.linear(x.double(), w.double(), b.double())
    rel = float((y.double() - exact).norm() / exact.norm())
    assert 1e-4 < rel < 0.05


def test_fp8_linear_gradients_are_straight_through_on_quantized_operands():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(6, 128, generator=gen, requires_grad=True)
    w = torch.randn(256, 128, generator=gen, requires_grad=True)
    g = torch.randn(6, 256, generator=gen)
    fp8_linear(x, w).backward(g)
    x_dq = dequantize_activation(*quantize_activation(x.detach()))
    w_dq = dequantize_weight(*quantize_weight(w.detach()))
    assert torch.allclose(x.grad, g @ w_dq, rtol=1e-5, atol=1e-5)
    assert torch.allclose(w.grad, g.T @ x_dq, rtol=1e-5, atol=1e-5)


def test_bf16_input_gives_bf16_output():
    x = torch.randn(4, 128, dtype=torch.bfloat16)
    w = torch.randn(128, 128, dtype=torch.bfloat16)
    y = fp8_linear(x, w)
    assert y.dtype == torch.bfloat16
    assert torch.allclose(y.float(), fp8_linear(x.float(), w.float()), rtol=2e-2, atol=2e-2)


def tiny_moe(seed: int = 0) -> Transformer:
    model = Transformer(preset_args("tiny-moe"))
    model.init_weights(seed)
    return model


def test_apply_fp8_swaps_eligible_modules_and_respects_ignore_list():
    model = tiny_moe()
    keys_before = list(model.state_dict())
    q_weight = model.layers[0].self_attn.q_proj.weight
    report = apply_fp8(model)
    assert "model.layers.0.self_attn.q_proj" in report.converted
    assert "model.layers.2.mlp.experts" in report.converted
    assert report.kept["lm_head"] == "ignored"
    assert "not multiples of 128" in report.kept["model.layers.0.self_attn.k_proj"]  # [64, 128]
    assert isinstance(model.layers[0].self_attn.q_proj, FP8Linear)
    assert model.layers[0].self_attn.q_proj.weight is q_weight  # same Parameter: optimizer state survives
    assert not isinstance(model.lm_head, FP8Linear)  # ignored: stays a plain linear
    assert model.layers[0].mlp.gate.weight.dtype == torch.float32  # router untouched
    assert list(model.state_dict()) == keys_before

    custom = tiny_moe()
    report = apply_fp8(custom, ignore=["lm_head", "model.layers.0.*", "*.o_proj"])
    assert not any(n.startswith("model.layers.0.") for n in report.converted)
    assert not any(n.endswith("o_proj") for n in report.converted)
    assert custom.layers[0].mlp.experts.expert_linear is None
    assert custom.layers[1].mlp.experts.expert_linear is not None


def test_fp8_model_is_close_to_high_precision_and_differs_from_it():
    model = tiny_moe(seed=1)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
        apply_fp8(model, backend="emulated")
        got = model(ids).logits
    rel = float((got - ref).norm() / ref.norm())
    assert 1e-4 < rel < 0.1


def test_expert_hook_none_and_plain_matmul_hook_agree():
    model = tiny_moe(seed=2)
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
        for layer in model.layers:
            layer.mlp.experts.expert_linear = lambda x, w: x @ w.T
        got = model(ids).logits
    assert torch.equal(got, ref)


def test_bad_backend_is_a_clear_error():
    with pytest.raises(ValueError, match=r"fp8 backend must be one of \['auto', 'emulated', 'scaled_mm'\]"):
        apply_fp8(tiny_moe(), backend="fast")
    with pytest.raises(ValueError, match="'scaled_mm' needs CUDA tensors"):
        fp8_linear(torch.randn(2, 128), torch.randn(128, 128), backend="scaled_mm")


# MLA families with every projection dim a multiple of 128 except kv_a_proj_with_mqa's
# kv_lora_rank + qk_rope_head_dim (160 here, 576 in DeepSeek-V3 / Kimi-K2 / GLM-5): as in the real
# models, that one stays in high precision.
_MLA_128 = dict(
    hidden_size=256,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=32,
    q_lora_rank=128,
    kv_lora_rank=128,
    qk_nope_head_dim=32,
    qk_rope_head_dim=32,
    v_head_dim=32,
    moe_intermediate_size=128,
)
_MLA_FAMILIES = {
    "tiny-dsv3": _MLA_128,
    "tiny-glm5": _MLA_128 | dict(index_n_heads=16, index_head_dim=32, index_topk=8),
}
_FAMILIES_128 = _MLA_FAMILIES | {
    "tiny-glm4moe": dict(
        hidden_size=256,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        moe_intermediate_size=128,
    )
}


def family_model(preset: str, seed: int = 0) -> Transformer:
    model = Transformer(replace(preset_args(preset), **_FAMILIES_128[preset]))
    model.init_weights(seed, std=0.05)
    return model


@pytest.mark.parametrize("preset", list(_MLA_FAMILIES))
def test_apply_fp8_on_mla_families_converts_projections_experts_and_shared_experts(preset):
    report = apply_fp8(family_model(preset))
    attn, mlp = "model.layers.1.self_attn", "model.layers.1.mlp"
    for name in ("q_a_proj", "q_b_proj", "kv_b_proj", "o_proj"):
        assert f"{attn}.{name}" in report.converted
    for name in ("experts", "shared_experts.gate_proj", "shared_experts.down_proj"):
        assert f"{mlp}.{name}" in report.converted
    assert "model.layers.0.mlp.gate_proj" in report.converted  # the dense first layer
    assert report.kept[f"{attn}.kv_a_proj_with_mqa"] == "dims [160, 256] not multiples of 128"
    if preset == "tiny-glm5":
        assert f"{attn}.indexer.wq_b" in report.converted
        assert "not multiples of 128" in report.kept[f"{attn}.indexer.weights_proj"]  # [16, 256]


@pytest.mark.parametrize("preset", list(_FAMILIES_128))
def test_fp8_attention_and_moe_blocks_of_new_families_are_close_to_high_precision(preset):
    """Same input through one layer's attention (MLA, or GLM-4.5's GQA with q/k/v bias; 8 tokens:
    GLM-5's indexer keeps them all) and its MoE block (routed + shared experts): FP8 is within
    e4m3's few percent of high precision, and really on."""
    hp, fp8 = family_model(preset, seed=1), family_model(preset, seed=1)
    apply_fp8(fp8, backend="emulated")
    x = torch.randn(2, 8, 256, generator=torch.Generator().manual_seed(3))
    pos = torch.arange(8).expand(2, 8)
    rope = hp.rotary(pos, torch.float32)
    with torch.no_grad():
        outs = [
            (m.layers[1].self_attn(x, rope, PackedCausalAttention(pos)), m.layers[1].mlp(x).out_BTD)
            for m in (hp, fp8)
        ]
    for ref, got in zip(*outs, strict=True):
        assert 1e-3 < float((got - ref).norm() / ref.norm()) < 0.1


def test_fp8_dsv3_gradients_follow_high_precision_under_replayed_routing():
    """A training backward through the FP8 model (routing replayed from the high-precision one, as
    R3 does): straight-through gradients reach the MLA projections, the experts and the router, and
    point the way the high-precision gradients do."""
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    hp, fp8 = family_model("tiny-dsv3", seed=1), family_model("tiny-dsv3", seed=1)
    apply_fp8(fp8, backend="emulated")
    with torch.no_grad():
        routing = hp(ids, return_routing=True).routed_experts
    grads = []
    for model in (hp, fp8):
        model(ids, routed_experts=routing).logits.pow(2).mean().backward()
        grads.append(dict(model.named_parameters()))
    for name in (
        "model.layers.1.self_attn.q_b_proj.weight",
        "model.layers.1.self_attn.kv_b_proj.weight",
        "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
        "model.layers.1.mlp.experts.gate_proj",
        "model.layers.1.mlp.shared_experts.up_proj.weight",
        "model.layers.1.mlp.gate.weight",
    ):
        ref, got = (g[name].grad.flatten() for g in grads)
        assert torch.isfinite(got).all()
        assert F.cosine_similarity(ref, got, dim=0) > 0.9, name
