"""A checkpoint or a publish that does not fit: refused before writing, or stopped by a full disk while
writing, with one error naming path, what and free space, and nothing left that looks complete."""

from __future__ import annotations

import errno
import os
import shutil

import pytest
import torch
from safetensors import SafetensorError

import asyncrl.model.hf as hf
from asyncrl.config.trainer import PublishConfig
from asyncrl.distributed import DistInfo
from asyncrl.model.tokenizer import save_byte_tokenizer
from asyncrl.run_dir import checkpoint_dir, weights_dir
from asyncrl.trainer.checkpoint import checkpoint_steps, save_checkpoint
from asyncrl.trainer.diskspace import state_bytes
from asyncrl.trainer.publish import FilesystemWeightPublisher
from asyncrl.transport import DiskFullError, stable_steps
from asyncrl.transport.disk import format_bytes

SINGLE = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def _little_space(monkeypatch, free: int = 1_000_000) -> None:
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=free))


def _trained(tiny_model, make_step_runner):
    """A model whose optimizer holds its AdamW moments, as after a step."""
    model = tiny_model()
    runner = make_step_runner(model)
    sum(p.float().square().sum() for p in model.parameters()).backward()
    runner.optimizer.step()
    return model, runner


def _save(run_dir, step, model, runner):
    return save_checkpoint(run_dir, step, model, runner.optimizer, runner.scheduler, SINGLE, keep_last=2)


def test_the_estimates_count_parameters_and_optimizer_moments(tiny_model, make_step_runner):
    model, runner = _trained(tiny_model, make_step_runner)
    params = sum(p.numel() for p in model.parameters()) * 4
    assert state_bytes(model) == params
    assert params * 3 <= state_bytes(model, runner.optimizer) <= params * 3 + 8 * len(runner.optimizer.state)


def test_a_checkpoint_that_does_not_fit_is_refused_before_writing(
    tiny_model, make_step_runner, tmp_path, monkeypatch
):
    model, runner = _trained(tiny_model, make_step_runner)
    _save(tmp_path, 1, model, runner)
    _little_space(monkeypatch)
    with pytest.raises(DiskFullError) as caught:
        _save(tmp_path, 2, model, runner)
    need = format_bytes(state_bytes(model, runner.optimizer))
    assert str(caught.value).startswith(
        f"no space left for the checkpoint of step 2 at {checkpoint_dir(tmp_path, 2)}: 1.0 MB free on its "
        f"filesystem, about {need} needed."
    )
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1"]


def test_a_full_disk_while_checkpointing_leaves_no_partial_checkpoint(
    tiny_model, make_step_runner, tmp_path, monkeypatch
):
    model, runner = _trained(tiny_model, make_step_runner)
    _save(tmp_path, 1, model, runner)

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)  # the checkpoint writer syncs every file it wrote
    with pytest.raises(
        DiskFullError,
        match=rf"^no space left for the checkpoint of step 2 at {checkpoint_dir(tmp_path, 2)}: ",
    ):
        _save(tmp_path, 2, model, runner)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1"]
    monkeypatch.undo()
    _save(tmp_path, 2, model, runner)  # space again: the same step is written whole
    assert checkpoint_steps(tmp_path) == [1, 2]


def _publisher(tmp_path, **publish) -> FilesystemWeightPublisher:
    tokenizer = tmp_path / "tokenizer"
    save_byte_tokenizer(tokenizer)
    cfg = PublishConfig(keep_last=2, **publish)
    return FilesystemWeightPublisher(tmp_path / "run", tokenizer, cfg, info=SINGLE)


def test_a_publish_that_does_not_fit_is_refused_before_writing(tiny_model, tmp_path, monkeypatch):
    publisher = _publisher(tmp_path)  # bfloat16: the check counts 2 bytes per parameter, not 4
    model = tiny_model()
    publisher.publish(model, 1)
    _little_space(monkeypatch, free=500_000)
    with pytest.raises(DiskFullError) as caught:
        publisher.publish(model, 2)
    run_dir = publisher.run_dir
    assert str(caught.value).startswith(
        f"no space left for the published weights of step 2 at {weights_dir(run_dir, 2)}: 500.0 KB free on "
        # the tokenizer adds < 0.1 MB
        f"its filesystem, about {format_bytes(state_bytes(model) // 2)} needed."
    )
    assert stable_steps(run_dir) == [1] and not [
        p for p in (run_dir / "weights").iterdir() if "step_2" in p.name
    ]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_full_disk_while_publishing_publishes_nothing(tiny_model, tmp_path, monkeypatch, overlap):
    publisher = _publisher(tmp_path, dtype="float32", overlap=overlap)
    model = tiny_model()

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(hf, "save_file", full)
    with pytest.raises(
        DiskFullError, match=r"^no space left for the published weights of step 1 at .*/weights/step_1: "
    ):
        publisher.publish(model, 1)
        publisher.wait()  # with overlap, the write fails in the background and is raised here
    assert list((publisher.run_dir / "weights").iterdir()) == []
    monkeypatch.undo()
    publisher.publish(model, 1)
    publisher.wait()
    assert stable_steps(publisher.run_dir) == [1]
    assert torch.equal(
        hf.from_pretrained(weights_dir(publisher.run_dir, 1)).lm_head.weight, model.lm_head.weight
    )
