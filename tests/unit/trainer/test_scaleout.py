"""Scale-out pieces that need no process group: early dims errors, the streaming HF writer, config checks."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

from asyncrl.config import ConfigError, load_config
from asyncrl.config.trainer import RLTrainerConfig
from asyncrl.distributed import ParallelDimsError
from asyncrl.model import HFCheckpointWriter, from_pretrained, save_pretrained
from asyncrl.model.hf import to_hf_state_dict
from asyncrl.tools.init_model import init_model
from asyncrl.trainer.session import TrainSession


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny-moe"
    init_model("tiny-moe", path, seed=0)
    return path


def _cfg(model_dir, tmp_path, *extra: str) -> RLTrainerConfig:
    argv = ["--model.path", str(model_dir), "--run-dir", str(tmp_path / "run"), "--max-steps", "1", *extra]
    return load_config(RLTrainerConfig, argv)


@pytest.mark.parametrize(
    ("world_size", "extra", "message"),
    [
        (2, ["--parallel.ep", "3"], "ep (3) must divide num_experts (8)"),
        (4, ["--parallel.dp_shard", "3"], "= 3 must equal world_size (4)"),
        (2, ["--parallel.cp", "4"], "world_size (2) divisible by dp_replicate * cp = 1 * 4 = 4"),
        (1, ["--parallel.ep", "2"], "ep (2) borrows its ranks from dp_shard * cp = 1 * 1 = 1"),
    ],
)
def test_bad_dims_fail_before_any_process_group(
    tiny_hf_dir, tmp_path, monkeypatch, world_size, extra, message
):
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    with pytest.raises(ParallelDimsError, match=re.escape(message)):
        TrainSession.build(_cfg(tiny_hf_dir, tmp_path, *extra))
    assert not dist.is_initialized()


def test_sequence_loss_is_rejected_with_context_parallel(tiny_hf_dir, tmp_path):
    with pytest.raises(ConfigError, match="parallel.cp = 2 splits them"):
        _cfg(tiny_hf_dir, tmp_path, "--parallel.cp", "2", "--loss.variant", "sequence")


def test_streaming_writer_matches_save_pretrained(tiny_hf_dir, tmp_path):
    model = from_pretrained(tiny_hf_dir)
    one, many, ref = tmp_path / "one", tmp_path / "many", tmp_path / "ref"
    save_pretrained(model, ref)
    for path, max_bytes in ((one, 4 * 1024**3), (many, 200_000)):
        path.mkdir()
        writer = HFCheckpointWriter(path, model, max_shard_bytes=max_bytes)
        for name, t in reversed(to_hf_state_dict(model).items()):  # arrival order does not matter
            writer.add(name, t)
        writer.finish()
    assert sorted(p.name for p in one.iterdir()) == sorted(p.name for p in ref.iterdir())
    assert (one / "model.safetensors").read_bytes() == (ref / "model.safetensors").read_bytes()
    assert (one / "config.json").read_text() == (ref / "config.json").read_text()
    files = sorted(p.name for p in many.iterdir())
    assert "model.safetensors.index.json" in files
    assert sum(f.endswith(".safetensors") for f in files) > 2
    reloaded = from_pretrained(many)
    for (name, p), q in zip(model.named_parameters(), reloaded.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
