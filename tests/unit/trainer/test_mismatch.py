"""Mismatch metrics on hand-built cases, the router's own top-k under replay, and the gate."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from asyncrl.config.mismatch import MismatchConfig
from asyncrl.model import Transformer, preset_args
from asyncrl.trainer.mismatch import (
    MismatchGateError,
    MismatchSums,
    check_mismatch_gate,
    k3_per_token,
    mismatch_by_staleness,
    mismatch_sums,
    routing_agreement,
)


def k3(r: float) -> float:
    return r - math.log(r) - 1


def test_k3_matches_formula_and_is_zero_on_policy():
    lp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    inf = torch.tensor([-1.0, -2.0 - math.log(2), -0.5 + math.log(4)], dtype=torch.float64)  # r=1, 2, 1/4
    got = k3_per_token(lp, inf)
    assert got.tolist() == pytest.approx([0.0, k3(2.0), k3(0.25)], rel=1e-12)
    tiny = k3_per_token(torch.tensor([1e-7]), torch.tensor([0.0]))  # k3 ~ (log r)^2 / 2 = 5e-15
    assert float(tiny[0]) == pytest.approx(5e-15, rel=1e-3)


def test_mismatch_sums_mean_max_and_ratio_outside():
    # ratios: 1, 2.5 (outside), 0.4 (outside), 1.9 (inside), masked-out 100
    ratios = [1.0, 2.5, 0.4, 1.9, 100.0]
    lp = torch.log(torch.tensor(ratios, dtype=torch.float64))
    inf = torch.zeros(5, dtype=torch.float64)
    mask = torch.tensor([True, True, True, True, False])
    sums = mismatch_sums(lp, inf, mask)
    expected = [k3(r) for r in ratios[:4]]
    assert sums.num_tokens == 4 and sums.num_outside == 2
    assert sums.kl_sum == pytest.approx(sum(expected))
    assert sums.kl_max == pytest.approx(max(expected))
    m = sums.metrics()
    assert m["mismatch_kl"] == pytest.approx(sum(expected) / 4)
    assert m["mismatch_ratio_outside"] == 0.5
    narrow = mismatch_sums(lp, inf, mask, ratio_low=0.95, ratio_high=1.05)
    assert narrow.num_outside == 3


def test_sums_combine_across_micro_batches():
    a = MismatchSums(kl_sum=1.0, kl_max=0.5, num_outside=1, num_tokens=10)
    b = MismatchSums(kl_sum=3.0, kl_max=0.9, num_outside=0, num_tokens=30)
    total = a + b
    assert total == MismatchSums(kl_sum=4.0, kl_max=0.9, num_outside=1, num_tokens=40)
    assert total.metrics()["mismatch_kl"] == pytest.approx(0.1)
    assert MismatchSums().metrics()["mismatch_kl"] == 0.0  # empty batch: zeros, not a division error


def test_empty_mask_and_bad_shapes():
    lp = torch.zeros(3)
    assert mismatch_sums(lp, lp, torch.zeros(3, dtype=torch.bool)) == MismatchSums()
    with pytest.raises(ValueError, match="must have the same shape"):
        mismatch_sums(lp, torch.zeros(4), torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask must be a bool tensor"):
        mismatch_sums(lp, lp, torch.ones(3))


def test_staleness_split_separates_current_and_old_tokens():
    lp = torch.log(torch.tensor([1.0, 1.0, 3.0, 0.2], dtype=torch.float64))
    inf = torch.zeros(4, dtype=torch.float64)
    mask = torch.tensor([True, True, True, False])
    versions = torch.tensor([4, 4, 2, 2])
    split = mismatch_by_staleness(lp, inf, mask, versions, trainer_version=4)
    assert split["current"] == MismatchSums(kl_sum=0.0, kl_max=0.0, num_outside=0, num_tokens=2)
    assert split["stale"].num_tokens == 1 and split["stale"].kl_sum == pytest.approx(k3(3.0))
    assert split["stale"].num_outside == 1
    with pytest.raises(ValueError, match="versions"):
        mismatch_by_staleness(lp, inf, mask, versions[:3], trainer_version=4)


def test_routing_agreement_counts_set_overlap_per_layer():
    replayed = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[0, 1], [0, 1]]])  # [T=3, L=2, K=2]
    own = torch.tensor([[[1, 0], [2, 5]], [[4, 6], [1, 0]], [[7, 7], [7, 7]]])
    mask = torch.tensor([True, True, False])
    agree = routing_agreement(replayed, own, mask)
    # layer 0: token0 {0,1}={1,0} -> 1; token1 {4,5}&{4,6} -> 0.5.  layer 1: 0.5 and 0.
    assert agree.tolist() == pytest.approx([0.75, 0.25])
    assert routing_agreement(replayed, own, mask, layers=[1]).tolist() == pytest.approx([0.25])
    assert torch.isnan(routing_agreement(replayed, own, torch.zeros(3, dtype=torch.bool))).all()
    with pytest.raises(ValueError, match="tokens, layers, top_k"):
        routing_agreement(replayed, own[:, :1], mask)


def test_model_reports_router_topk_under_replay():
    model = Transformer(preset_args("tiny-moe"))
    model.init_weights(seed=3)
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        own = model(ids, return_routing=True)
        assert own.router_topk is None  # no replay: the ids used are the router's own
        same = model(ids, routed_experts=own.routed_experts, return_routing=True)
        assert torch.equal(same.router_topk, own.routed_experts)
        forced = torch.zeros_like(own.routed_experts)
        forced[..., 1] = 1  # every token to experts {0, 1}
        replayed = model(ids, routed_experts=forced, return_routing=True)
    assert torch.equal(replayed.routed_experts, forced)
    mask = torch.ones(20, dtype=torch.bool)
    agree = routing_agreement(forced[0], replayed.router_topk[0], mask)
    # expected overlap computed by hand from the router's own choices in the replayed forward
    own_sets = replayed.router_topk[0]
    manual = [
        sum(len({0, 1} & set(own_sets[t, layer].tolist())) / 2 for t in range(20)) / 20 for layer in range(4)
    ]
    assert agree.tolist() == pytest.approx(manual)
    assert max(manual) < 1.0  # forcing two experts on every token disagrees
    assert routing_agreement(own.routed_experts[0], same.router_topk[0], mask).tolist() == [1.0] * 4


def test_gate_passes_warns_and_fails():
    assert check_mismatch_gate(1e-4, max_kl=None, mode="fail", step=1) is None
    assert check_mismatch_gate(1e-4, max_kl=1e-3, mode="fail", step=1) is None
    with pytest.warns(UserWarning, match=r"step 7: mismatch KL 2\.000e-03 exceeds"):
        msg = check_mismatch_gate(2e-3, max_kl=1e-3, mode="warn", step=7)
    assert "max_mismatch_kl" in msg
    with pytest.raises(MismatchGateError, match="exceeds mismatch.max_mismatch_kl"):
        check_mismatch_gate(2e-3, max_kl=1e-3, mode="fail", step=7)
    with pytest.raises(MismatchGateError):
        check_mismatch_gate(float("nan"), max_kl=1e-3, mode="fail", step=7)
    with pytest.raises(ValueError, match="gate must be"):
        check_mismatch_gate(0.0, max_kl=1e-3, mode="stop", step=7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_mismatch_gate(5e-4, max_kl=1e-3, mode="warn", step=1)  # under the limit: silent


def test_mismatch_config_validates():
    cfg = MismatchConfig(max_mismatch_kl=1e-3, gate="fail")
    assert cfg.ratio_low == 0.5 and cfg.ratio_high == 2.0
    with pytest.raises(ValueError, match="ratio_low"):
        MismatchConfig(ratio_low=2.0, ratio_high=1.0)
    with pytest.raises(ValueError):
        MismatchConfig(max_mismatch_kl=-1.0)
    with pytest.raises(ValueError):
        MismatchConfig(gate="explode")
