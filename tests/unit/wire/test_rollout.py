"""Rollout samples: validation, batch encoding round trip, routed-experts base64."""

from __future__ import annotations

import numpy as np
import pytest

from asyncrl.wire import (
    BatchFormatError,
    RolloutBatch,
    RolloutSample,
    RoutedExperts,
    decode_batch,
    encode_batch,
)


def _sample(n: int, seed: int, routing: bool = True) -> RolloutSample:
    rng = np.random.default_rng(seed)
    return RolloutSample(
        token_ids=rng.integers(0, 260, n).astype(np.int32),
        loss_mask=rng.random(n) > 0.5,
        inference_logprobs=-rng.random(n).astype(np.float32),
        advantages=np.full(n, 0.5, np.float32),
        temperatures=np.ones(n, np.float32),
        policy_versions=rng.integers(0, 3, n).astype(np.int32),
        routed_experts=rng.integers(0, 8, (n, 4, 2)).astype(np.uint8) if routing else None,
        reward=float(seed),
        env="reverse-text",
        episode_id=f"ep{seed}",
    )


def test_batch_round_trip_is_exact():
    batch = RolloutBatch(step=4, samples=[_sample(5, 1), _sample(9, 2)], metrics={"reward": 0.3})
    arrays, meta = encode_batch(batch)
    back = decode_batch(arrays, meta)
    assert back.step == 4 and back.metrics == {"reward": 0.3}
    for a, b in zip(batch.samples, back.samples, strict=True):
        for f in ("token_ids", "loss_mask", "inference_logprobs", "policy_versions", "routed_experts"):
            x, y = getattr(a, f), getattr(b, f)
            assert x.dtype == y.dtype and np.array_equal(x, y), f
        assert (a.reward, a.env, a.episode_id) == (b.reward, b.env, b.episode_id)


def test_field_errors_name_the_field():
    s = _sample(4, 0)
    with pytest.raises(BatchFormatError, match="'advantages' has 3 tokens but token_ids has 4"):
        RolloutSample(**{**s.__dict__, "advantages": np.zeros(3, np.float32)})
    with pytest.raises(BatchFormatError, match="'token_ids' must be int32"):
        RolloutSample(**{**s.__dict__, "token_ids": s.token_ids.astype(np.int64)})
    with pytest.raises(BatchFormatError, match="'routed_experts' must be uint8 or uint16"):
        RolloutSample(**{**s.__dict__, "routed_experts": s.routed_experts.astype(np.int32)})
    arrays, meta = encode_batch(RolloutBatch(step=0, samples=[s]))
    del arrays["temperatures"]
    with pytest.raises(BatchFormatError, match="rollouts/step_0: missing field 'temperatures'"):
        decode_batch(arrays, meta, where="rollouts/step_0")
    with pytest.raises(BatchFormatError, match="routed_experts differ across samples"):
        other = _sample(3, 1)
        encode_batch(RolloutBatch(step=0, samples=[s, RolloutSample(**{**other.__dict__,
                                  "routed_experts": other.routed_experts[:, :2]})]))  # fmt: skip


def test_a_sample_without_routing_round_trips_as_no_routing():
    """Mixed batches encode (a deadline-cut or aborted episode may lack routing); the flag is per sample."""
    batch = RolloutBatch(step=2, samples=[_sample(5, 1), _sample(3, 2, routing=False), _sample(4, 3)])
    arrays, meta = encode_batch(batch)
    assert arrays["routed_experts"].shape == (12, 4, 2)
    assert (arrays["routed_experts"][5:8] == 0).all()
    back = decode_batch(arrays, meta)
    assert back.samples[1].routed_experts is None
    np.testing.assert_array_equal(back.samples[0].routed_experts, batch.samples[0].routed_experts)
    np.testing.assert_array_equal(back.samples[2].routed_experts, batch.samples[2].routed_experts)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
def test_routed_experts_base64_round_trip(dtype):
    arr = np.random.default_rng(0).integers(0, 255 if dtype == np.uint8 else 300, (7, 3, 2)).astype(dtype)
    msg = RoutedExperts.from_array(arr, start=2)
    back = RoutedExperts.model_validate_json(msg.model_dump_json()).to_array()
    assert back.dtype == dtype and np.array_equal(back, arr) and msg.start == 2
