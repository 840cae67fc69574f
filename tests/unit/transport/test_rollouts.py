"""Filesystem rollout transport: per-rank parts, atomic writes, waiting reads, the single-file layout,
and errors that name file and field."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from safetensors import SafetensorError
from safetensors.numpy import save_file

import asyncrl.transport.rollouts as rollouts
from asyncrl.run_dir import batch_dir
from asyncrl.transport import (
    DiskFullError,
    RolloutTimeoutError,
    read_batch,
    write_batch,
)
from asyncrl.transport.rollouts import LEGACY_BATCH_FILE, MANIFEST_FILE
from asyncrl.wire import BatchFormatError, RolloutBatch, RolloutSample, encode_batch


def _sample(n: int, seed: int, routed: bool = True) -> RolloutSample:
    rng = np.random.default_rng(seed)
    return RolloutSample(
        token_ids=rng.integers(0, 256, n).astype(np.int32),
        loss_mask=np.arange(n) >= n // 2,
        inference_logprobs=-rng.random(n).astype(np.float32),
        advantages=np.full(n, 0.5, np.float32),
        temperatures=np.full(n, 0.7, np.float32),
        policy_versions=np.full(n, 3, np.int32),
        routed_experts=rng.integers(0, 8, (n, 4, 2)).astype(np.uint8) if routed else None,
        reward=1.5,
        env="reverse-text",
        episode_id=f"ep-{seed}",
    )


def _batch(step: int) -> RolloutBatch:
    return RolloutBatch(step=step, samples=[_sample(7, 1), _sample(12, 2)], metrics={"dropped": 1.0})


def test_write_then_read_round_trips_every_field(tmp_path):
    batch = _batch(4)
    final = write_batch(tmp_path, batch)
    assert final == batch_dir(tmp_path, 4)
    assert [p.name for p in final.parent.iterdir()] == ["step_4"]  # no temporary left behind
    got = read_batch(tmp_path, 4, timeout_s=1)
    assert got.step == 4 and got.metrics == {"dropped": 1.0}
    for a, b in zip(batch.samples, got.samples):
        for name in (
            "token_ids",
            "loss_mask",
            "inference_logprobs",
            "advantages",
            "temperatures",
            "policy_versions",
        ):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
        np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
        assert (b.reward, b.env, b.episode_id) == (1.5, "reverse-text", a.episode_id)


def test_read_waits_for_a_batch_written_later(tmp_path):
    writer = threading.Timer(0.3, write_batch, args=(tmp_path, _batch(1)))
    writer.start()
    start = time.monotonic()
    got = read_batch(tmp_path, 1, timeout_s=10)
    writer.join()
    assert got.step == 1 and time.monotonic() - start >= 0.25


def test_read_times_out_with_a_message_naming_the_directory(tmp_path):
    with pytest.raises(RolloutTimeoutError, match=r"step 9 after 0s: .*rollouts/step_9 does not exist"):
        read_batch(tmp_path, 9, timeout_s=0.1)


def test_writing_the_same_step_twice_is_refused(tmp_path):
    write_batch(tmp_path, _batch(2))
    with pytest.raises(FileExistsError, match="step_2"):
        write_batch(tmp_path, _batch(2))


def _write_raw(tmp_path, step: int, arrays, meta) -> str:
    d = batch_dir(tmp_path, step)
    d.mkdir(parents=True)
    save_file(arrays, str(d / LEGACY_BATCH_FILE), metadata=meta)
    return str(d / LEGACY_BATCH_FILE)


def test_corrupt_file_names_the_file(tmp_path):
    d = batch_dir(tmp_path, 1)
    d.mkdir(parents=True)
    (d / LEGACY_BATCH_FILE).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(BatchFormatError, match=f"{d / LEGACY_BATCH_FILE}.*safetensors"):
        read_batch(tmp_path, 1, timeout_s=1)


def test_missing_field_names_file_and_field(tmp_path):
    arrays, meta = encode_batch(_batch(1))
    del arrays["advantages"]
    path = _write_raw(tmp_path, 1, arrays, meta)
    with pytest.raises(BatchFormatError, match=f"{path}: missing field 'advantages'"):
        read_batch(tmp_path, 1, timeout_s=1)


def test_wrong_shape_names_file_and_field(tmp_path):
    arrays, meta = encode_batch(_batch(1))
    arrays["temperatures"] = arrays["temperatures"][:-3]
    path = _write_raw(tmp_path, 1, arrays, meta)
    with pytest.raises(BatchFormatError, match=f"{path}: field 'temperatures' has 16 tokens"):
        read_batch(tmp_path, 1, timeout_s=1)


def test_step_mismatch_is_reported(tmp_path):
    arrays, meta = encode_batch(_batch(5))
    path = _write_raw(tmp_path, 6, arrays, meta)
    with pytest.raises(BatchFormatError, match=f"{path}: metadata 'step' is 5, expected 6"):
        read_batch(tmp_path, 6, timeout_s=1)


def test_step_directory_without_batch_file(tmp_path):
    batch_dir(tmp_path, 3).mkdir(parents=True)
    with pytest.raises(BatchFormatError, match=f"missing {MANIFEST_FILE} \\(and no {LEGACY_BATCH_FILE}"):
        read_batch(tmp_path, 3, timeout_s=1)


def test_a_full_disk_is_an_os_error_naming_the_batch_and_nothing_is_left(tmp_path, monkeypatch):
    def full(*args, **kwargs):  # what safetensors raises on ENOSPC: its own type, errno only in the text
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(rollouts, "save_file", full)
    with pytest.raises(OSError) as caught:  # an OSError: the orchestrator's batch writer retries it
        write_batch(tmp_path, _batch(3))
    assert isinstance(caught.value, DiskFullError)
    assert str(caught.value).startswith(
        f"no space left for the batch of step 3 at {batch_dir(tmp_path, 3)}: "
    )
    assert list((tmp_path / "rollouts").iterdir()) == []
