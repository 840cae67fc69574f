"""Weight transport mechanics: staging, rename, STABLE marker, keep-last-K, waiting."""

from __future__ import annotations

import pytest

from asyncrl.transport import (
    STABLE_MARKER,
    WeightsTimeoutError,
    latest_stable_step,
    stable_steps,
    stage_weights,
    wait_for_weights,
    weights_dir,
)


def _publish(run_dir, step, keep_last=None, payload=b"w"):
    existed = weights_dir(run_dir, step).exists()
    with stage_weights(run_dir, step, keep_last=keep_last) as tmp:
        assert existed or not weights_dir(run_dir, step).exists()  # invisible until the body finishes
        (tmp / "model.safetensors").write_bytes(payload)


def test_publish_renames_and_marks_stable(tmp_path):
    _publish(tmp_path, 1)
    final = weights_dir(tmp_path, 1)
    assert sorted(p.name for p in final.iterdir()) == [STABLE_MARKER, "model.safetensors"]
    assert [p.name for p in final.parent.iterdir()] == ["step_1"]
    assert latest_stable_step(tmp_path) == 1


def test_keep_last_prunes_oldest(tmp_path):
    for step in range(1, 6):
        _publish(tmp_path, step, keep_last=2)
    assert stable_steps(tmp_path) == [4, 5]
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["step_4", "step_5"]


def test_failure_inside_publish_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError), stage_weights(tmp_path, 3) as tmp:
        (tmp / "partial").write_bytes(b"x")
        raise RuntimeError("disk full")
    assert list((tmp_path / "weights").iterdir()) == []
    assert latest_stable_step(tmp_path) is None


def test_republishing_a_step_replaces_it(tmp_path):
    _publish(tmp_path, 2, payload=b"old")
    _publish(tmp_path, 2, payload=b"new")
    assert (weights_dir(tmp_path, 2) / "model.safetensors").read_bytes() == b"new"


def test_directory_without_stable_is_not_a_version(tmp_path):
    weights_dir(tmp_path, 7).mkdir(parents=True)
    assert stable_steps(tmp_path) == []
    with pytest.raises(WeightsTimeoutError, match="step 7"):
        wait_for_weights(tmp_path, 7, timeout_s=0.1)
    (weights_dir(tmp_path, 7) / STABLE_MARKER).touch()
    assert wait_for_weights(tmp_path, 7, timeout_s=1) == weights_dir(tmp_path, 7)
