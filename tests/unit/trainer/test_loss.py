"""Loss variants on hand-computed examples, masking boundaries, and the on-policy identities."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import TypeAdapter

from asyncrl.config import load_config
from asyncrl.config.trainer import (
    LossConfig,
    MISLossConfig,
    SequenceLossConfig,
    TISLossConfig,
    TrustRegionLossConfig,
)
from asyncrl.trainer.loss import LossInputs, mismatch_kl, rl_loss, sft_loss

PI = [0.5, 0.5, 0.2, 0.9]
MU = [0.4, 0.8, 0.5, 0.6]
ADV = [1.0, 1.0, -1.0, -1.0]
RATIO = [p / m for p, m in zip(PI, MU)]  # 1.25, 0.625, 0.4, 1.5
KL_COEF = 0.1


def _inputs(pi=PI, mu=MU, adv=ADV, mask=None, seq_ids=None) -> LossInputs:
    n = len(pi)
    return LossInputs(
        logprobs=torch.tensor(pi, dtype=torch.float64).log().requires_grad_(),
        inference_logprobs=torch.tensor(mu, dtype=torch.float64).log(),
        advantages=torch.tensor(adv, dtype=torch.float64),
        loss_mask=torch.ones(n, dtype=torch.bool) if mask is None else torch.tensor(mask),
        seq_ids=torch.zeros(n, dtype=torch.long) if seq_ids is None else torch.tensor(seq_ids),
    )


def _expected(keep: list[bool], weights: list[float], num_loss_tokens: float) -> tuple[float, list[float]]:
    """Loss value and d loss / d logpi for a -r*A policy-gradient term plus kl_coef * (log r)^2."""
    loss, grads = 0.0, []
    for k, w, a, r in zip(keep, weights, ADV, RATIO):
        pen = KL_COEF * math.log(r) ** 2
        loss += (-w * a if k else 0.0) + pen
        grads.append(((-w * a) if k else 0.0) + 2 * KL_COEF * math.log(r))
    return loss / num_loss_tokens, [g / num_loss_tokens for g in grads]


def _check(cfg: LossConfig, inp: LossInputs, keep, weights, num_loss_tokens=8.0, masked=None):
    res = rl_loss(inp, cfg, num_loss_tokens)
    res.loss.backward()
    want_loss, want_grad = _expected(keep, weights, num_loss_tokens)
    assert res.loss.item() == pytest.approx(want_loss, rel=1e-12)
    assert inp.logprobs.grad.tolist() == pytest.approx(want_grad, rel=1e-12)
    assert res.num_masked.item() == (masked if masked is not None else keep.count(False))
    assert res.num_loss_tokens.item() == 4
    return res


def test_trust_region_masks_in_the_advantage_direction():
    # pi - mu = [0.1, -0.3, -0.3, 0.3]: only token 2 (A < 0, pi fell by 0.3 > delta_low) leaves the region.
    # Token 1 fell by 0.3 too, but its advantage is positive, so the update pushes it back: kept.
    # Token 3 rose by 0.3, but its advantage is negative: kept.
    cfg = TrustRegionLossConfig(delta_low=0.2, delta_high=0.2, kl_coef=KL_COEF)
    _check(cfg, _inputs(), keep=[True, True, False, True], weights=RATIO)


def test_trust_region_boundaries():
    cfg = TrustRegionLossConfig(delta_low=0.2, delta_high=0.1, kl_coef=0.0)
    mu = [0.5, 0.5, 0.5, 0.5]
    pi = [0.6 - 1e-6, 0.6 + 1e-6, 0.3 + 1e-6, 0.3 - 1e-6]  # just inside/outside +0.1 and -0.2
    res = rl_loss(_inputs(pi=pi, mu=mu, adv=[1.0, 1.0, -1.0, -1.0]), cfg, 4.0)
    assert res.num_masked.item() == 2
    # The masked tokens get no gradient at all.
    inp = _inputs(pi=pi, mu=mu, adv=[1.0, 1.0, -1.0, -1.0])
    rl_loss(inp, cfg, 4.0).loss.backward()
    g = inp.logprobs.grad
    assert g[1] == 0 and g[3] == 0 and g[0] != 0 and g[2] != 0


def _rare_token_inputs() -> LossInputs:
    # Token 0: the engine sampled it at mu = 1e-4, the trainer gives it pi = 0.15, so r = 1500, yet
    # pi - mu = 0.1499 lies inside the trust region's band. Token 1 (A < 0) is the same case.
    # Token 2: r = 1.5, below the cap.
    return _inputs(pi=[0.15, 0.15, 0.3], mu=[1e-4, 1e-4, 0.2], adv=[1.0, -1.0, 1.0])


def _loss(variant: str, **keys) -> LossConfig:
    """A -r * A variant with its own mask bounds opened wide, so only the ratio cap acts."""
    wide = {"mis": {"mis_high": 1e4}, "sequence": {"seq_high": 1e4}}.get(variant, {})
    return TypeAdapter(LossConfig).validate_python({"variant": variant, **wide, **keys})


def _pg_grads(cfg: LossConfig, inp: LossInputs, num_loss_tokens: float = 3.0) -> tuple[list[float], int]:
    """d loss / d logpi with the (log r)^2 penalty taken out, times N; and the masked count."""
    res = rl_loss(inp, cfg, num_loss_tokens)
    res.loss.backward()
    log_r = (inp.logprobs - inp.inference_logprobs).detach()
    pen = 2 * cfg.kl_coef * log_r
    return ((inp.logprobs.grad - pen / num_loss_tokens) * num_loss_tokens).tolist(), int(res.num_masked)


def test_trust_region_caps_the_importance_weight_by_default():
    cfg = TrustRegionLossConfig()  # the default variant, ratio_cap 2.0, truncate
    assert cfg.variant == "trust_region" and cfg.ratio_cap == 2.0 and cfg.ratio_cap_mode == "truncate"
    inp = _rare_token_inputs()
    res = rl_loss(inp, cfg, 3.0)
    log_r = [math.log(0.15 / 1e-4), math.log(0.15 / 1e-4), math.log(1.5)]
    # value: -min(r, 2) * A per token, plus the penalty
    want = (-2.0 * 1 - 2.0 * -1 - 1.5 * 1 + cfg.kl_coef * sum(x * x for x in log_r)) / 3
    assert res.loss.item() == pytest.approx(want, rel=1e-9)
    grads, masked = _pg_grads(cfg, _rare_token_inputs())
    # capped tokens keep their direction with weight C: -C * A; the token below the cap gets -r * A
    assert grads == pytest.approx([-2.0, 2.0, -1.5], rel=1e-9)
    assert masked == 0


def test_uncapped_trust_region_weighs_the_rare_token_1500():
    grads, _ = _pg_grads(load_config(TrustRegionLossConfig, ["--ratio-cap", "inf"]), _rare_token_inputs())
    assert grads == pytest.approx([-1500.0, 1500.0, -1.5], rel=1e-6)


def test_ratio_cap_mask_mode_drops_capped_tokens():
    for variant in ("trust_region", "sequence", "mis"):
        cfg = _loss(variant, ratio_cap=2.0, ratio_cap_mode="mask")
        grads, masked = _pg_grads(cfg, _rare_token_inputs())
        assert grads == pytest.approx([0.0, 0.0, -1.5], abs=1e-9), variant
        assert masked == 2, variant


def test_ratio_cap_applies_to_mis_and_sequence_and_stays_finite():
    for variant in ("mis", "sequence"):
        cfg = _loss(variant)
        grads, _ = _pg_grads(cfg, _rare_token_inputs())
        assert grads == pytest.approx([-2.0, 2.0, -1.5], rel=1e-9), variant
    # r overflows float32 (log r = 100; A < 0, so the trust region keeps the token that rose):
    # the capped weight and its gradient stay finite
    inp = LossInputs(
        logprobs=torch.tensor([-0.1], requires_grad=True),
        inference_logprobs=torch.tensor([-100.1]),
        advantages=torch.tensor([-1.0]),
        loss_mask=torch.tensor([True]),
        seq_ids=torch.tensor([0]),
    )
    res = rl_loss(inp, TrustRegionLossConfig(kl_coef=0.0), 1.0)
    res.loss.backward()
    assert res.loss.item() == pytest.approx(2.0) and inp.logprobs.grad.item() == pytest.approx(2.0)


def test_ratio_cap_below_one_is_rejected():
    with pytest.raises(ValueError, match="ratio_cap"):
        TrustRegionLossConfig(ratio_cap=0.5)


def test_tis_truncates_a_detached_weight():
    cfg = TISLossConfig(tis_cap=1.3, kl_coef=KL_COEF)
    inp = _inputs()
    res = rl_loss(inp, cfg, 8.0)
    res.loss.backward()
    w = [min(r, 1.3) for r in RATIO]
    # value: -w * logpi * A; gradient: -w * A (w is a constant), plus the penalty.
    want = (
        sum(-wi * math.log(p) * a + KL_COEF * math.log(r) ** 2 for wi, p, a, r in zip(w, PI, ADV, RATIO)) / 8
    )
    assert res.loss.item() == pytest.approx(want, rel=1e-12)
    want_grad = [(-wi * a + 2 * KL_COEF * math.log(r)) / 8 for wi, a, r in zip(w, ADV, RATIO)]
    assert inp.logprobs.grad.tolist() == pytest.approx(want_grad, rel=1e-12)
    assert res.num_masked.item() == 0


def test_mis_masks_ratios_outside_bounds():
    cfg = MISLossConfig(mis_low=0.5, mis_high=1.4, kl_coef=KL_COEF)
    _check(cfg, _inputs(), keep=[True, True, False, False], weights=RATIO)  # r = 0.4 and 1.5 are out


def test_mis_bounds_are_inclusive():
    cfg = MISLossConfig(mis_low=0.5, mis_high=2.0, kl_coef=0.0)
    res = rl_loss(_inputs(pi=[0.25, 0.5, 0.2, 0.9], mu=[0.5, 0.25, 0.4, 0.45]), cfg, 4.0)
    assert res.num_masked.item() == 0  # ratios exactly 0.5 and 2.0 stay


def test_sequence_masking_drops_whole_sequences():
    # geometric-mean ratios: seq 0 sqrt(1.25 * 0.625) = 0.884, seq 1 sqrt(0.4 * 1.5) = 0.775
    cfg = SequenceLossConfig(seq_low=0.8, seq_high=1.2, kl_coef=KL_COEF)
    _check(cfg, _inputs(seq_ids=[0, 0, 1, 1]), keep=[True, True, False, False], weights=RATIO)
    cfg = SequenceLossConfig(seq_low=0.7, seq_high=1.2, kl_coef=KL_COEF)
    _check(cfg, _inputs(seq_ids=[0, 0, 1, 1]), keep=[True] * 4, weights=RATIO)


def test_tokens_outside_the_loss_mask_do_not_count():
    cfg = TrustRegionLossConfig(kl_coef=KL_COEF)
    pi, mu = [*PI, 0.01], [*MU, 0.99]  # a wild prompt token that must be ignored
    inp = _inputs(pi=pi, mu=mu, adv=[*ADV, 5.0], mask=[True] * 4 + [False])
    res = rl_loss(inp, cfg, 8.0)
    res.loss.backward()
    assert res.num_loss_tokens.item() == 4 and inp.logprobs.grad[4] == 0
    assert res.loss.item() == pytest.approx(_expected([True, True, False, True], RATIO, 8.0)[0], rel=1e-12)


@pytest.mark.parametrize("variant", ["trust_region", "tis", "mis", "sequence"])
def test_on_policy_ratio_is_one_and_kl_zero(variant):
    lp = torch.tensor([-0.3, -1.2, -2.0, -0.1], dtype=torch.float64)
    inp = LossInputs(
        logprobs=lp.clone().requires_grad_(),
        inference_logprobs=lp.clone(),
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64),
        loss_mask=torch.ones(4, dtype=torch.bool),
        seq_ids=torch.tensor([0, 0, 1, 1]),
    )
    res = rl_loss(inp, TypeAdapter(LossConfig).validate_python({"variant": variant}), 4.0)
    res.loss.backward()
    assert res.mismatch_kl_sum.item() == 0.0 and res.num_masked.item() == 0
    # With r == 1 every variant is the plain policy gradient -A * grad(logpi) / N.
    assert inp.logprobs.grad.tolist() == pytest.approx([-0.25, 0.25, -0.125, 0.125], rel=1e-12)


def test_mismatch_kl_is_k3():
    log_r = torch.tensor([0.0, math.log(2.0), math.log(0.5)], dtype=torch.float64)
    assert mismatch_kl(log_r).tolist() == pytest.approx([0.0, 2 - math.log(2) - 1, 0.5 + math.log(2) - 1])


def test_sft_loss_is_mean_negative_logprob_over_loss_tokens():
    inp = _inputs(mask=[False, True, True, True])
    res = sft_loss(inp, 3.0)
    assert res.loss.item() == pytest.approx(-(math.log(0.5) + math.log(0.2) + math.log(0.9)) / 3)


def test_config_rejects_inverted_bounds():
    with pytest.raises(ValueError, match="mis_low"):
        MISLossConfig(mis_low=2.0, mis_high=1.0)
