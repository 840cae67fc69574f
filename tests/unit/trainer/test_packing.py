"""Bin packing, the target-shift convention, data-parallel sharding, and packing invariance."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from asyncrl.config.trainer import TrustRegionLossConfig
from asyncrl.trainer.loss import LossInputs, rl_loss
from asyncrl.trainer.packing import build_micro_batch, pack_samples, plan_bins, shard_samples
from asyncrl.trainer.synthetic import synthetic_batch
from asyncrl.wire import BatchFormatError, RolloutSample


def _sample(tokens: list[int], mask: list[int], version: int = 0) -> RolloutSample:
    n = len(tokens)
    return RolloutSample(
        token_ids=np.array(tokens, np.int32),
        loss_mask=np.array(mask, bool),
        inference_logprobs=np.arange(n, dtype=np.float32) * -0.1,
        advantages=np.full(n, 2.0, np.float32),
        temperatures=np.full(n, 0.5, np.float32),
        policy_versions=np.full(n, version, np.int32),
    )


def test_plan_bins_places_every_sequence_once_within_seq_len():
    lengths = [5, 3, 4, 2, 7, 1]
    bins = plan_bins(lengths, seq_len=7)
    assert sorted(i for b in bins for i in b) == list(range(6))
    assert all(sum(lengths[i] for i in b) <= 7 for b in bins)
    assert len(bins) == 4  # 22 tokens need at least 4 rows of 7 (7 | 5+2 | 4+3 | 1 -> FFD finds 4)


def test_sequence_longer_than_seq_len_is_an_error():
    with pytest.raises(BatchFormatError, match="sample 1 has 9 tokens, more than seq_len=8"):
        plan_bins([3, 9], seq_len=8)


def test_micro_batch_shifts_fields_to_targets_and_restarts_positions():
    mb = build_micro_batch([_sample([10, 11, 12], [0, 1, 1], 4), _sample([20, 21], [0, 1], 5)], replay=False)
    assert mb.input_ids.tolist() == [[10, 11, 12, 20, 21]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert mb.target_ids.tolist() == [11, 12, 0, 21, 0]
    assert mb.loss_mask.tolist() == [True, True, False, True, False]
    assert mb.inference_logprobs.tolist() == pytest.approx([-0.1, -0.2, 0.0, -0.1, 0.0])
    assert mb.temperatures.tolist() == [0.5, 0.5, 1.0, 0.5, 1.0]
    assert mb.policy_versions.tolist() == [4, 4, 0, 5, 0]
    assert mb.seq_ids.tolist() == [0, 0, 0, 1, 1]
    assert mb.routed_experts is None


def test_context_version_is_the_oldest_version_sampled_so_far_in_the_sequence():
    # A two-turn episode whose first completion spans an update (2 -> 3), then a fresh sample.
    spanning = dataclasses.replace(
        _sample([1, 2, 3, 4, 5, 6, 7], [0, 1, 1, 1, 0, 1, 1]),
        policy_versions=np.array([-1, 2, 3, 3, -1, 4, 4], np.int32),
    )
    fresh = dataclasses.replace(
        _sample([8, 9, 10], [0, 1, 1]), policy_versions=np.array([-1, 4, 4], np.int32)
    )
    mb = build_micro_batch([spanning, fresh], replay=False)
    assert mb.policy_versions.tolist() == [2, 3, 3, -1, 4, 4, 0, 4, 4, 0]
    # targets after the update still attend over KV that version 2 computed
    assert mb.context_versions.tolist() == [2, 2, 2, 2, 2, 2, 0, 4, 4, 0]


def test_context_version_takes_the_kv_versions_of_each_turn():
    # Turn 1 sampled by v3 over a prompt v2 prefilled; turn 2 (v4) over a prompt all of v4.
    kv = dataclasses.replace(
        _sample([1, 2, 3, 4, 5, 6, 7], [0, 1, 1, 0, 0, 1, 1]),
        policy_versions=np.array([-1, 3, 3, -1, -1, 4, 4], np.int32),
        kv_versions=np.array([-1, 2, 2, -1, -1, 4, 4], np.int32),
    )
    unreported = dataclasses.replace(kv, kv_versions=None)  # a batch from before the field: as before
    mb = build_micro_batch([kv, unreported], replay=False)
    assert mb.context_versions[:7].tolist() == [2, 2, 2, 2, 2, 2, 0]
    assert mb.context_versions[7:].tolist() == [3, 3, 3, 3, 3, 3, 0]
    # A prompt prefilled by v0 under tokens sampled by v1: never "current" for the v1 trainer.
    spans = dataclasses.replace(
        _sample([1, 2, 3, 4], [0, 1, 1, 1]),
        policy_versions=np.array([-1, 1, 1, 1], np.int32),
        kv_versions=np.array([-1, 0, 0, 0], np.int32),
    )
    mb = build_micro_batch([spans], replay=False)
    assert mb.policy_versions.tolist() == [1, 1, 1, 0] and mb.context_versions.tolist() == [0, 0, 0, 0]


def test_shards_are_disjoint_complete_and_balanced():
    samples = [_sample(list(range(n)), [1] * n) for n in (9, 2, 7, 4, 4, 3, 8, 1)]
    shards = [shard_samples(samples, r, 3) for r in range(3)]
    ids = sorted(id(s) for shard in shards for s in shard)
    assert ids == sorted(id(s) for s in samples)
    loads = [sum(s.num_tokens for s in shard) for shard in shards]
    assert max(loads) - min(loads) <= 2, loads


def _loss_and_grads(make_step_runner, model, micro_batches, chunk_size=1024):
    runner = make_step_runner(model, chunk_size=chunk_size)
    total = float(sum(int(mb.loss_mask.sum()) for mb in micro_batches))
    model.zero_grad()
    loss = 0.0
    for mb in micro_batches:
        lp, _ = runner.forward_micro_batch(mb)
        inp = LossInputs(
            logprobs=lp,
            inference_logprobs=mb.inference_logprobs,
            advantages=mb.advantages,
            loss_mask=mb.loss_mask,
            seq_ids=mb.seq_ids,
        )
        res = rl_loss(inp, TrustRegionLossConfig(), total)
        res.loss.backward()
        loss += res.loss.item()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return loss, grads


def test_packed_and_unpacked_give_the_same_loss_and_gradients(tiny_model, make_step_runner):
    model = tiny_model()
    batch = synthetic_batch(model, step=1, num_samples=6, prompt_len=8, completion_len=12, seed=3)
    packed = pack_samples(batch.samples, seq_len=64, replay=True)
    assert len(packed) < len(batch.samples)  # really packed several per row
    unpacked = [build_micro_batch([s], replay=True) for s in batch.samples]
    loss_p, grads_p = _loss_and_grads(make_step_runner, model, packed)
    loss_u, grads_u = _loss_and_grads(make_step_runner, model, unpacked)
    assert loss_p == pytest.approx(loss_u, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(grads_p, grads_u, rtol=1e-4, atol=1e-6)


def test_chunked_lm_head_in_the_step_matches_unchunked(tiny_model, make_step_runner):
    model = tiny_model()
    batch = synthetic_batch(model, step=1, num_samples=4, prompt_len=8, completion_len=12, seed=4)
    mbs = pack_samples(batch.samples, seq_len=128, replay=True)
    loss_small, grads_small = _loss_and_grads(make_step_runner, model, mbs, chunk_size=5)
    loss_big, grads_big = _loss_and_grads(make_step_runner, model, mbs, chunk_size=4096)
    assert loss_small == pytest.approx(loss_big, rel=1e-6, abs=1e-8)
    torch.testing.assert_close(grads_small, grads_big, rtol=1e-5, atol=1e-7)


def test_samples_without_routing_train_in_their_own_micro_batches(tiny_model, make_step_runner):
    """Per-sample "no routing": the unrouted sample is packed apart and routed by the trainer's router."""
    model = tiny_model()
    batch = synthetic_batch(model, step=1, num_samples=4, prompt_len=8, completion_len=12, seed=5)
    unrouted = dataclasses.replace(batch.samples[1], routed_experts=None)
    samples = [batch.samples[0], unrouted, *batch.samples[2:]]
    packed = pack_samples(samples, seq_len=256, replay=True)
    assert len(packed) == 2 and packed[0].num_sequences == 3 and packed[1].num_sequences == 1
    assert packed[0].routed_experts is not None and packed[1].routed_experts is None
    # The unrouted micro-batch gives exactly the loss of that sample trained without replay.
    loss_mixed, _ = _loss_and_grads(make_step_runner, model, packed[1:])
    loss_plain, _ = _loss_and_grads(make_step_runner, model, [build_micro_batch([unrouted], replay=False)])
    assert loss_mixed == pytest.approx(loss_plain, rel=1e-6)
