"""YaRN RoPE scaling against transformers 5.x in fp32, at positions beyond the original context."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.model import ModelConfigError, from_pretrained, load_args, save_pretrained
from asyncrl.model.args import YarnScaling
from asyncrl.model.rope import cos_sin_factor, inverse_frequencies

TOL = 1e-4
ORIGINAL = 64
# mscale != mscale_all_dim: cos/sin are scaled, and MLA's softmax scale too
YARN = {
    "rope_type": "yarn",
    "rope_theta": 5000.0,
    "factor": 8.0,
    "original_max_position_embeddings": ORIGINAL,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 0.9,
    "mscale_all_dim": 0.6,
}


def _ids_and_positions(vocab: int, start: int = 5 * ORIGINAL) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (2, 23), generator=torch.Generator().manual_seed(0))
    return ids, torch.arange(start, start + ids.shape[1]).expand_as(ids)


def _logit_diff(hf, ours) -> float:
    ids, pos = _ids_and_positions(hf.config.vocab_size)
    with torch.no_grad():
        ref = hf(ids, position_ids=pos).logits
        got = ours(ids, position_ids=pos).logits
    assert ref.abs().max() > 0.1
    return (got - ref).abs().max().item()


def test_yarn_frequencies_ramp_between_kept_and_interpolated():
    # rotary width 8, theta 5000, 64 original positions: the ramp runs over frequencies 0..2
    scaling = YarnScaling(**{k: v for k, v in YARN.items() if k not in ("rope_type", "rope_theta")})
    plain, yarn = inverse_frequencies(8, 5000.0, None), inverse_frequencies(8, 5000.0, scaling)
    assert torch.allclose(yarn / plain, torch.tensor([1.0, (1 + 1 / 8) / 2, 1 / 8, 1 / 8]))
    assert cos_sin_factor(scaling) == pytest.approx((0.09 * 2.0794 + 1) / (0.06 * 2.0794 + 1), rel=1e-4)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm_moe_dsa"])
def test_mla_yarn_logits_match_transformers(family_checkpoint, model_type):
    path, hf = family_checkpoint(model_type, seed=11, rope_parameters=YARN)
    ours = from_pretrained(path)
    assert ours.args.rope_scaling.mscale_all_dim == 0.6
    assert _logit_diff(hf, ours) <= TOL


def test_qwen3_yarn_logits_match_transformers(hf_checkpoint):
    path, hf = hf_checkpoint("qwen3", seed=2, rope_parameters=YARN | {"mscale": None, "mscale_all_dim": None})
    assert _logit_diff(hf, from_pretrained(path)) <= TOL


def test_kimi_style_rope_scaling_loads_as_transformers_reads_it_and_saves_back(family_checkpoint, tmp_path):
    """The older `rope_scaling` key with `type` and a top-level rope_theta (DeepSeek-V3's and
    Kimi-K2's config.json); YaRN changes the logits; what we save, transformers reads the same."""
    path, _ = family_checkpoint("deepseek_v3", seed=4)
    cfg = json.loads((path / "config.json").read_text())
    scaling = {k: v for k, v in YARN.items() if k not in ("rope_type", "rope_theta")} | {"beta_fast": 1.0}
    cfg |= {"rope_theta": 5000.0, "rope_scaling": {"type": "yarn", **scaling}, "rope_parameters": None}
    plain = from_pretrained(path)
    (path / "config.json").write_text(json.dumps(cfg))
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    assert hf.config.rope_parameters["rope_type"] == "yarn"
    ours = from_pretrained(path)
    assert ours.args.rope_scaling.beta_fast == 1.0 and ours.args.rope_theta == 5000.0
    assert _logit_diff(hf, ours) <= TOL
    assert _logit_diff(hf, plain) > 100 * TOL  # the test sees YaRN
    save_pretrained(ours, tmp_path / "resaved")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "resaved", attn_implementation="eager").eval()
    assert _logit_diff(again, ours) <= TOL


def test_other_rope_types_and_bad_yarn_values_are_refused(hf_checkpoint):
    path, _ = hf_checkpoint("qwen3")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | {"rope_scaling": {"type": "linear", "factor": 2.0}}))
    with pytest.raises(ModelConfigError, match="RoPE scaling 'linear' is not supported.*default, yarn"):
        load_args(path)
    (path / "config.json").write_text(json.dumps(cfg | {"rope_parameters": YARN | {"factor": 0.5}}))
    with pytest.raises(ModelConfigError, match="YaRN 'factor' must be >= 1"):
        load_args(path)
