"""Mismatch metrics as the RL step reports them, and the max_mismatch_kl gate in the trainer loop."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from asyncrl.config.trainer import TrustRegionLossConfig
from asyncrl.trainer.loss import rl_loss
from asyncrl.trainer.mismatch import MismatchGateError, check_mismatch_gate
from asyncrl.trainer.packing import pack_samples
from asyncrl.trainer.synthetic import synthetic_batch


def _rl():
    cfg = TrustRegionLossConfig()
    return lambda inputs, n: rl_loss(inputs, cfg, n)


def test_on_policy_step_reports_zero_mismatch_and_full_routing_agreement(tiny_model, make_step_runner):
    model = tiny_model()
    batch = synthetic_batch(model, step=3, num_samples=4, prompt_len=8, completion_len=12, seed=1)
    result = make_step_runner(model).step(
        pack_samples(batch.samples, 64, replay=True), _rl(), trained_version=2
    )
    m = result.mismatch
    assert m["mismatch_kl_current"] < 1e-10 and m["mismatch_kl_max"] < 1e-8
    assert m["mismatch_tokens_stale_fraction"] == 0.0 and m["mismatch_ratio_outside"] == 0.0
    assert m["routing_agreement"] == pytest.approx(1.0)
    assert {f"routing_agreement/layer_{i}" for i in model.args.moe_layers} <= set(m)


def test_stale_tokens_and_foreign_routing_are_told_apart(tiny_model, make_step_runner):
    model = tiny_model()
    batch = synthetic_batch(model, step=3, num_samples=4, prompt_len=8, completion_len=12, seed=2)
    rng = np.random.default_rng(0)
    samples = []
    for i, s in enumerate(batch.samples):
        if i % 2:  # half the samples: "sampled by an older version" whose logprobs differ
            s = dataclasses.replace(
                s,
                policy_versions=np.full_like(s.policy_versions, 1),
                inference_logprobs=np.where(s.loss_mask, s.inference_logprobs - 0.5, 0.0).astype(np.float32),
            )
        a = model.args  # a foreign routing: the replayed ids disagree with the router's own top-k
        scores = rng.random((s.num_tokens, a.num_hidden_layers, a.num_experts))
        samples.append(
            dataclasses.replace(s, routed_experts=np.argsort(scores, -1)[..., :2].astype(np.uint8))
        )
    result = make_step_runner(model).step(pack_samples(samples, 64, replay=True), _rl(), trained_version=2)
    m = result.mismatch
    assert 0.3 < m["mismatch_tokens_stale_fraction"] < 0.7
    # exp(0.5) - 0.5 - 1 = 0.149 on the stale half (the current half only sees replay differences)
    assert m["mismatch_kl_stale"] > m["mismatch_kl_current"]
    assert m["mismatch_kl_stale"] > 0.1
    assert m["routing_agreement"] < 0.6  # random pairs of 8 experts overlap 25% on average


def test_tokens_after_an_update_inside_a_completion_count_as_stale(tiny_model, make_step_runner):
    # Each completion switches from version 1 to the trained version 2 halfway. Its later tokens
    # carry version 2, but the engine sampled them over KV that version 1 computed, so their
    # logprobs differ from a forward of version 2: they are off-policy drift, not engine mismatch.
    model = tiny_model()
    batch = synthetic_batch(model, step=3, num_samples=4, prompt_len=8, completion_len=12, seed=3)
    samples = []
    for s in batch.samples:
        idx = np.flatnonzero(s.loss_mask)
        versions = np.full_like(s.policy_versions, -1)
        versions[idx] = np.where(np.arange(idx.size) < idx.size // 2, 1, 2)
        late = np.zeros_like(s.loss_mask)
        late[idx[idx.size // 2 :]] = True
        shifted = np.where(late, s.inference_logprobs - 0.5, s.inference_logprobs).astype(np.float32)
        samples.append(dataclasses.replace(s, policy_versions=versions, inference_logprobs=shifted))
    result = make_step_runner(model).step(pack_samples(samples, 64, replay=True), _rl(), trained_version=2)
    m = result.mismatch
    assert m["mismatch_tokens_stale_fraction"] == 1.0  # every token has version 1 in its context
    assert m["mismatch_kl_current"] == 0.0 and m["mismatch_kl_stale"] > 0.05


def test_gate_warns_or_fails():
    assert check_mismatch_gate(1e-4, max_kl=1e-3, mode="fail", step=1) is None
    with pytest.warns(UserWarning, match="step 2: mismatch KL 5.000e-03 exceeds"):
        check_mismatch_gate(5e-3, max_kl=1e-3, mode="warn", step=2)
    with pytest.raises(MismatchGateError, match="max_mismatch_kl"):
        check_mismatch_gate(5e-3, max_kl=1e-3, mode="fail", step=3)
