"""Batches split per trainer data rank: balanced parts, a rank reads its own part only, another rank
count re-splits, single-file batches still read, and a half-written step stays invisible."""

from __future__ import annotations

import os

import numpy as np
import pytest
from safetensors.numpy import save_file

import asyncrl.transport.rollouts as rollouts
from asyncrl.run_dir import batch_dir, rollouts_root
from asyncrl.transport import (
    RolloutTimeoutError,
    batch_steps,
    read_batch,
    read_batch_part,
    read_manifest,
    write_batch,
)
from asyncrl.transport.rollouts import LEGACY_BATCH_FILE, MANIFEST_FILE, load_batch_file, part_file
from asyncrl.wire import BatchFormatError, RolloutBatch, RolloutSample, encode_batch, split_by_tokens

LENGTHS = [31, 7, 19, 44, 3, 12, 25, 9, 16, 28, 5, 21]


def _sample(i: int, n: int) -> RolloutSample:
    rng = np.random.default_rng(i)
    return RolloutSample(
        token_ids=rng.integers(0, 256, n).astype(np.int32),
        loss_mask=np.arange(n) >= n // 3,
        inference_logprobs=-rng.random(n).astype(np.float32),
        advantages=np.full(n, 0.25 * i, np.float32),
        temperatures=np.ones(n, np.float32),
        policy_versions=np.full(n, 2, np.int32),
        routed_experts=rng.integers(0, 64, (n, 6, 4)).astype(np.uint8),
        reward=float(i % 3),
        env="reverse-text",
        episode_id=f"ep-{i}",
    )


def _batch(step: int, lengths: list[int] = LENGTHS) -> RolloutBatch:
    samples = [_sample(i, n) for i, n in enumerate(lengths)]
    return RolloutBatch(step=step, samples=samples, metrics={"reward/mean": 1.0})


def _ids(batch: RolloutBatch) -> list[str]:
    return [s.episode_id for s in batch.samples]


def _spy_opens(monkeypatch) -> list[str]:
    """Record the name of every safetensors file the transport opens."""
    opened, real = [], rollouts.safe_open

    def spy(path, *args, **kwargs):
        opened.append(os.path.basename(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(rollouts, "safe_open", spy)
    return opened


@pytest.mark.parametrize("num_parts", [1, 2, 3, 5])
def test_each_sample_lands_in_exactly_one_part_balanced_by_tokens(tmp_path, num_parts):
    final = write_batch(tmp_path, _batch(2), num_parts=num_parts)
    assert sorted(p.name for p in final.iterdir()) == sorted(
        [MANIFEST_FILE, *(part_file(r) for r in range(num_parts))]
    )
    parts = [load_batch_file(final / part_file(r), expected_step=2) for r in range(num_parts)]
    ids = [i for p in parts for i in _ids(p)]
    assert sorted(ids) == sorted(_ids(_batch(2))) and len(set(ids)) == len(LENGTHS)
    loads = [p.num_tokens for p in parts]
    assert max(loads) - min(loads) <= max(LENGTHS), loads
    # part r is what a trainer reading the whole batch would give data rank r
    plan = split_by_tokens(LENGTHS, num_parts)
    assert [_ids(p) for p in parts] == [[f"ep-{i}" for i in idx] for idx in plan]
    assert read_manifest(tmp_path, 2, timeout_s=0).parts == plan


def test_the_whole_batch_reads_back_in_its_order_from_every_part(tmp_path):
    batch = _batch(4)
    write_batch(tmp_path, batch, num_parts=3)
    got = read_batch(tmp_path, 4, timeout_s=0)
    assert got.step == 4 and got.metrics == {"reward/mean": 1.0} and _ids(got) == _ids(batch)
    for a, b in zip(batch.samples, got.samples):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
        np.testing.assert_array_equal(a.advantages, b.advantages)


def test_a_rank_opens_its_own_part_only(tmp_path, monkeypatch):
    final = write_batch(tmp_path, _batch(1), num_parts=4)
    opened = _spy_opens(monkeypatch)
    share = read_batch_part(tmp_path, 1, rank=2, num_ranks=4, timeout_s=0)
    assert opened == [part_file(2)]
    assert _ids(share.batch) == [f"ep-{i}" for i in split_by_tokens(LENGTHS, 4)[2]]
    part_bytes = (final / part_file(2)).stat().st_size
    assert share.num_bytes_read == part_bytes + (final / MANIFEST_FILE).stat().st_size
    whole = sum((final / part_file(r)).stat().st_size for r in range(4))
    assert share.manifest.num_bytes == whole and share.num_bytes_read < 0.4 * whole
    # the batch-wide figures the trainer logs come from the manifest, not from the part
    assert share.manifest.num_samples == len(LENGTHS)
    assert share.manifest.rewards == [float(i % 3) for i in range(len(LENGTHS))]


def _assert_same_samples(got: list[RolloutSample], want: list[RolloutSample]) -> None:
    assert [s.episode_id for s in got] == [s.episode_id for s in want]
    for a, b in zip(got, want):
        for name in ("token_ids", "loss_mask", "inference_logprobs", "advantages", "routed_experts"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
        assert (a.reward, a.env, a.kv_versions) == (b.reward, b.env, b.kv_versions)


def test_another_rank_count_re_splits_to_the_same_samples_reading_only_their_tokens(tmp_path, monkeypatch):
    lengths = [20 * n for n in LENGTHS]  # long enough that the parts' headers are a small share
    final = write_batch(tmp_path, _batch(3, lengths), num_parts=4)
    whole = sum((final / part_file(r)).stat().st_size for r in range(4))
    opened = _spy_opens(monkeypatch)
    shares = []
    for rank in range(3):
        with pytest.warns(UserWarning, match="holds 4 part\\(s\\).* this trainer has 3: data rank"):
            shares.append(read_batch_part(tmp_path, 3, rank=rank, num_ranks=3, timeout_s=0))
    samples = _batch(3, lengths).samples
    for rank, share in enumerate(shares):
        _assert_same_samples(share.batch.samples, [samples[i] for i in split_by_tokens(lengths, 3)[rank]])
        # its samples' tokens, the headers of the parts it opened and the manifest: about a third
        assert share.num_bytes_read < 0.4 * whole, (rank, share.num_bytes_read, whole)
    assert set(opened) <= {part_file(r) for r in range(4)}
    with pytest.warns(UserWarning, match="data rank 0 read its samples out of them"):  # a dp-1 resume
        one = read_batch_part(tmp_path, 3, rank=0, num_ranks=1, timeout_s=0)
    _assert_same_samples(one.batch.samples, samples)
    assert one.num_bytes_read > whole  # every part, whole, and the manifest


def test_more_parts_than_samples_leaves_empty_parts_without_files(tmp_path, monkeypatch):
    final = write_batch(tmp_path, _batch(1, [5, 9]), num_parts=3)
    assert not (final / part_file(2)).exists()
    opened = _spy_opens(monkeypatch)
    share = read_batch_part(tmp_path, 1, rank=2, num_ranks=3, timeout_s=0)
    assert share.batch.samples == [] and opened == []
    assert _ids(read_batch(tmp_path, 1, timeout_s=0)) == ["ep-0", "ep-1"]


def test_a_single_file_batch_of_an_older_run_still_reads(tmp_path):
    batch = _batch(5)
    d = batch_dir(tmp_path, 5)
    d.mkdir(parents=True)
    arrays, meta = encode_batch(batch)
    save_file(arrays, str(d / LEGACY_BATCH_FILE), metadata=meta)
    assert _ids(read_batch(tmp_path, 5, timeout_s=0)) == _ids(batch)
    solo = read_batch_part(tmp_path, 5, rank=0, num_ranks=1, timeout_s=0)
    assert _ids(solo.batch) == _ids(batch) and solo.manifest.num_parts == 1
    with pytest.warns(UserWarning, match="holds 1 part"):
        half = read_batch_part(tmp_path, 5, rank=1, num_ranks=2, timeout_s=0)
    assert _ids(half.batch) == [f"ep-{i}" for i in split_by_tokens(LENGTHS, 2)[1]]
    assert half.num_bytes_read == (d / LEGACY_BATCH_FILE).stat().st_size


def test_a_write_that_fails_between_parts_leaves_no_step(tmp_path, monkeypatch):
    real, calls = rollouts.save_file, []

    def fail_on_second_part(arrays, path, metadata=None):
        calls.append(os.path.basename(path))
        if len(calls) == 2:
            raise OSError(5, "Input/output error")
        real(arrays, path, metadata=metadata)

    monkeypatch.setattr(rollouts, "save_file", fail_on_second_part)
    with pytest.raises(OSError, match="Input/output error"):
        write_batch(tmp_path, _batch(2), num_parts=3)
    assert calls == [part_file(0), part_file(1)]
    assert list(rollouts_root(tmp_path).iterdir()) == [] and batch_steps(tmp_path) == []


def test_a_half_written_step_is_invisible_to_readers(tmp_path):
    # what a writer killed mid-write leaves: its hidden temporary directory with some parts
    write_batch(tmp_path, _batch(1), num_parts=2)
    (rollouts_root(tmp_path) / ".step_2.abc123").mkdir()
    arrays, meta = encode_batch(_batch(2))
    save_file(arrays, str(rollouts_root(tmp_path) / ".step_2.abc123" / part_file(0)), metadata=meta)
    assert batch_steps(tmp_path) == [1]
    with pytest.raises(RolloutTimeoutError, match="step 2"):
        read_batch_part(tmp_path, 2, rank=0, num_ranks=2, timeout_s=0.1)


def test_a_missing_or_foreign_part_is_an_error_naming_the_file(tmp_path):
    final = write_batch(tmp_path, _batch(1), num_parts=2)
    (final / part_file(1)).unlink()
    with pytest.raises(BatchFormatError, match=f"{final / part_file(1)}: missing batch file"):
        read_batch_part(tmp_path, 1, rank=1, num_ranks=2, timeout_s=0)
    other = write_batch(tmp_path, _batch(2), num_parts=2)
    os.replace(other / part_file(0), other / part_file(1))  # part 0's samples under part 1's name
    with pytest.raises(BatchFormatError, match=f"{other / part_file(1)}: holds samples of .* tokens"):
        read_batch_part(tmp_path, 2, rank=1, num_ranks=2, timeout_s=0)


def test_a_manifest_of_another_step_is_refused(tmp_path):
    final = write_batch(tmp_path, _batch(1), num_parts=2)
    os.rename(final, batch_dir(tmp_path, 7))
    with pytest.raises(BatchFormatError, match=f"{MANIFEST_FILE}: 'step' is 1, expected 7"):
        read_batch_part(tmp_path, 7, rank=0, num_ranks=2, timeout_s=0)
