"""Rollout samples: validation, batch encoding round trip, routed-experts base64."""

from __future__ import annotations

import json

import numpy as np
import pytest

from asyncrl.wire import (
    BatchFormatError,
    RolloutBatch,
    RolloutSample,
    RoutedExperts,
    decode_batch,
    encode_batch,
    select_encoded,
    split_by_tokens,
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
        encode_batch(
            RolloutBatch(
                step=0,
                samples=[
                    s,
                    RolloutSample(**{**other.__dict__, "routed_experts": other.routed_experts[:, :2]}),
                ],
            )
        )


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


def _with_kv(s: RolloutSample, oldest: int) -> RolloutSample:
    """`s` with kv_versions: `oldest` on its sampled tokens, -1 elsewhere."""
    kv = np.where(s.loss_mask, np.minimum(s.policy_versions, oldest), -1).astype(np.int32)
    return RolloutSample(**{**s.__dict__, "kv_versions": kv})


def test_kv_versions_round_trip_with_without_and_mixed():
    with_kv = [_with_kv(_sample(5, 1), 0), _with_kv(_sample(4, 3), 1)]
    back = decode_batch(*encode_batch(RolloutBatch(step=3, samples=with_kv)))
    for a, b in zip(with_kv, back.samples, strict=True):
        assert b.kv_versions.dtype == np.int32 and np.array_equal(a.kv_versions, b.kv_versions)
    arrays, meta = encode_batch(RolloutBatch(step=3, samples=[_sample(5, 1), _sample(4, 3)]))
    assert "kv_versions" not in arrays  # a batch without them is written as before
    assert [s.kv_versions for s in decode_batch(arrays, meta).samples] == [None, None]
    mixed = [with_kv[0], _sample(3, 2)]
    arrays, meta = encode_batch(RolloutBatch(step=3, samples=mixed))
    assert arrays["kv_versions"].shape == (8,) and (arrays["kv_versions"][5:] == -1).all()
    back = decode_batch(arrays, meta)
    assert np.array_equal(back.samples[0].kv_versions, mixed[0].kv_versions)
    assert back.samples[1].kv_versions is None


def test_a_batch_file_from_before_kv_versions_decodes_without_them():
    arrays, meta = encode_batch(RolloutBatch(step=1, samples=[_with_kv(_sample(5, 1), 0)]))
    del arrays["kv_versions"]
    samples = json.loads(meta["samples"])
    meta["samples"] = json.dumps([{k: v for k, v in m.items() if k != "kv_versions"} for m in samples])
    assert decode_batch(arrays, meta).samples[0].kv_versions is None


def test_kv_versions_errors_name_the_field():
    s = _sample(4, 0)
    with pytest.raises(BatchFormatError, match="'kv_versions' must be int32, got int64"):
        RolloutSample(**{**s.__dict__, "kv_versions": np.zeros(4, np.int64)})
    with pytest.raises(BatchFormatError, match="'kv_versions' has 3 tokens but token_ids has 4"):
        RolloutSample(**{**s.__dict__, "kv_versions": np.zeros(3, np.int32)})
    with pytest.raises(BatchFormatError, match=r"'kv_versions' must be 1-D \[T\], got shape \(4, 1\)"):
        RolloutSample(**{**s.__dict__, "kv_versions": np.zeros((4, 1), np.int32)})
    arrays, meta = encode_batch(RolloutBatch(step=0, samples=[_with_kv(s, 0)]))
    arrays["kv_versions"] = arrays["kv_versions"][:3]
    with pytest.raises(BatchFormatError, match="step_0: field 'kv_versions' has 3 tokens, lengths sum to 4"):
        decode_batch(arrays, meta, where="step_0")


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
def test_routed_experts_base64_round_trip(dtype):
    arr = np.random.default_rng(0).integers(0, 255 if dtype == np.uint8 else 300, (7, 3, 2)).astype(dtype)
    msg = RoutedExperts.from_array(arr, start=2)
    back = RoutedExperts.model_validate_json(msg.model_dump_json()).to_array()
    assert back.dtype == dtype and np.array_equal(back, arr) and msg.start == 2


@pytest.mark.parametrize("num_parts", [1, 2, 3, 4, 7])
def test_split_puts_every_sample_in_one_part_balanced_by_tokens(num_parts):
    lengths = np.random.default_rng(num_parts).integers(1, 500, 61).tolist()
    parts = split_by_tokens(lengths, num_parts)
    assert len(parts) == num_parts
    assert sorted(i for p in parts for i in p) == list(range(61))
    assert all(p == sorted(p) for p in parts)
    loads = [sum(lengths[i] for i in p) for p in parts]
    # longest first to the lightest part: no part exceeds another by more than the last sample it took
    assert max(loads) - min(loads) <= max(lengths)
    assert max(loads) <= sum(lengths) / num_parts + max(lengths)


def test_split_is_longest_first_to_the_lightest_part():
    assert split_by_tokens([9, 2, 7, 4], 2) == [[0, 1], [2, 3]]
    assert split_by_tokens([5, 5, 5], 2) == [[0, 2], [1]]  # ties go to the lower part
    assert split_by_tokens([3], 3) == [[0], [], []]
    with pytest.raises(ValueError, match="num_parts must be >= 1"):
        split_by_tokens([3], 0)


def test_select_encoded_reads_only_the_chosen_samples_rows():
    samples = [_sample(5, 1), _sample(9, 2, routing=False), _sample(4, 3), _sample(7, 4)]
    arrays, meta = encode_batch(RolloutBatch(step=2, samples=samples, metrics={"m": 1.0}))
    asked = []

    def rows(name):
        def read(start, stop):
            asked.append((name, start, stop))
            return arrays[name][start:stop]

        return read

    picked, picked_meta = select_encoded({name: rows(name) for name in arrays}, meta, [3, 1])
    back = decode_batch(picked, picked_meta)
    want = decode_batch(*encode_batch(RolloutBatch(step=2, samples=[samples[3], samples[1]])))
    assert [s.episode_id for s in back.samples] == ["ep4", "ep2"] and back.metrics == {"m": 1.0}
    for a, b in zip(back.samples, want.samples):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        np.testing.assert_array_equal(a.inference_logprobs, b.inference_logprobs)
        assert (a.routed_experts is None) == (b.routed_experts is None)
    # token columns are read over samples 3 (rows 18:25) and 1 (rows 5:14) only
    assert {(start, stop) for name, start, stop in asked if name == "token_ids"} == {(18, 25), (5, 14)}
