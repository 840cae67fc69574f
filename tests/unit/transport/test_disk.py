"""Disk space checks and full-disk errors: what they name, and which errors they leave alone."""

from __future__ import annotations

import errno
import shutil
from collections import namedtuple

import pytest
from safetensors import SafetensorError

import asyncrl.transport.disk as disk
from asyncrl.transport import DiskFullError, check_free_space, disk_full_as_error

_Usage = namedtuple("_Usage", "total used free")


def _free(monkeypatch, free: int) -> list:
    asked = []

    def usage(path):
        asked.append(path)
        return _Usage(10**12, 10**12 - free, free)

    monkeypatch.setattr(disk.shutil, "disk_usage", usage)
    return asked


def test_the_check_names_path_what_free_and_needed_space(tmp_path, monkeypatch):
    asked = _free(monkeypatch, 5_000_000)
    target = tmp_path / "checkpoints" / "step_2"  # does not exist yet: its filesystem is asked
    check_free_space(target, 4_000_000, "checkpoint of step 2")
    with pytest.raises(DiskFullError) as caught:
        check_free_space(target, 21_200_000, "checkpoint of step 2")
    assert str(caught.value) == (
        f"no space left for the checkpoint of step 2 at {target}: 5.0 MB free on its filesystem, about "
        "21.2 MB needed. Free space (or keep fewer checkpoints / published weights), then continue the "
        "run with --resume"
    )
    assert asked[-1] == tmp_path


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        OSError(errno.EDQUOT, "Disk quota exceeded"),
        SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
    ],
)
def test_a_full_disk_or_quota_becomes_one_error(tmp_path, monkeypatch, error):
    _free(monkeypatch, 1_500)
    want = rf"^no space left for the batch of step 1 at {tmp_path}: 1.5 KB free on its filesystem\. Free"
    with pytest.raises(DiskFullError, match=want), disk_full_as_error(tmp_path, "batch of step 1"):
        raise error


@pytest.mark.parametrize(
    "error",
    [OSError(errno.EACCES, "Permission denied"), SafetensorError("header too large"), ValueError("x")],
)
def test_other_errors_pass_through_unchanged(tmp_path, error):
    with pytest.raises(type(error)) as caught, disk_full_as_error(tmp_path, "batch of step 1"):
        raise error
    assert caught.value is error


def test_free_space_is_that_of_the_real_filesystem(tmp_path):
    assert abs(disk.free_bytes(tmp_path / "a" / "b") - shutil.disk_usage(tmp_path).free) < 10**8
