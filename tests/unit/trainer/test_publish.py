"""Publishing in the serving format (fp32, bf16, FP8) that transformers and the embedded engine load, and
the background write: the next step runs while it writes, STABLE comes last, failures are raised."""

from __future__ import annotations

import errno
import json
import threading

import pytest
import torch

import asyncrl.model.hf as hf
from asyncrl.config.inference import InferenceConfig
from asyncrl.config.trainer import PublishConfig
from asyncrl.distributed import DistInfo
from asyncrl.inference import Engine, SamplingOptions
from asyncrl.model import from_pretrained, to_hf_state_dict
from asyncrl.model.fp8 import FP8_DTYPE, dequantize_weight, quantize_weight
from asyncrl.run_dir import weights_dir
from asyncrl.tools.init_model import init_model
from asyncrl.trainer.publish import FilesystemWeightPublisher, PublishError, assign_files
from asyncrl.transport import STABLE_MARKER, stable_steps

SINGLE = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny-moe"
    init_model("tiny-moe", path, seed=0)
    return path


def _publisher(run_dir, model_dir, **publish) -> FilesystemWeightPublisher:
    return FilesystemWeightPublisher(run_dir, model_dir, PublishConfig(keep_last=2, **publish), SINGLE)


def _published(model, run_dir, model_dir, step=1, **publish):
    publisher = _publisher(run_dir, model_dir, **publish)
    publisher.publish(model, step)
    publisher.wait()
    return weights_dir(run_dir, step)


def _engine(model_dir, **cfg) -> Engine:
    config = InferenceConfig(
        model=str(model_dir), device="cpu", kv_cache_tokens=512, max_model_len=128, **cfg
    )
    return Engine.from_config(config)


def _generates(engine: Engine, state: dict, version: int) -> None:
    engine.load_weights(state, version)
    engine.add_request("r", [1, 2, 3], SamplingOptions(max_tokens=4, ignore_eos=True))
    tokens = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    assert len(tokens) == 4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_published_files_are_the_weights_in_the_serving_dtype(model_dir, tmp_path, dtype):
    from transformers import AutoModelForCausalLM

    model = from_pretrained(model_dir)
    path = _published(model, tmp_path, model_dir, dtype=dtype)
    assert json.loads((path / "config.json").read_text())["torch_dtype"] == dtype
    ours = from_pretrained(path, dtype=torch.float32)
    serving = getattr(torch, dtype)
    for (name, p), q in zip(model.named_parameters(), ours.parameters()):
        assert torch.equal(q, p.detach().to(serving).float()), name
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([list(b"serving dtype")])
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids).logits, rtol=1e-4, atol=1e-4)
    engine = _engine(model_dir, dtype="bfloat16")
    state = engine.read_weights(str(path))
    assert torch.equal(state["lm_head.weight"], model.lm_head.weight.detach().to(torch.bfloat16))
    _generates(engine, state, 1)


def test_fp8_publication_loads_in_an_fp8_engine(model_dir, tmp_path):
    model = from_pretrained(model_dir)
    path = _published(model, tmp_path, model_dir, fp8=True)
    config = json.loads((path / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["quantization_config"]["quant_method"] == "fp8"
    engine = _engine(model_dir, dtype="bfloat16", fp8={"enabled": True})
    state = engine.read_weights(str(path))
    w = model.layers[0].mlp.experts.up_proj.detach()  # [E, I, D], FP8 per expert
    want = torch.stack([dequantize_weight(*quantize_weight(w[e])) for e in range(w.shape[0])])
    assert torch.equal(state["model.layers.0.mlp.experts.up_proj"], want.to(torch.bfloat16))
    assert torch.equal(
        state["model.layers.0.self_attn.q_proj.weight"],
        model.layers[0].self_attn.q_proj.weight.to(torch.bfloat16),
    )
    _generates(engine, state, 1)


def test_files_are_shared_out_largest_first_to_the_least_loaded_rank():
    sizes = {"a": 50, "b": 40, "c": 30, "d": 20, "e": 10}
    owner = assign_files(sizes, 2)
    assert owner == {"a": 0, "b": 1, "c": 1, "d": 0, "e": 0}  # 80 and 70 bytes
    assert assign_files({"a": 5}, 4) == {"a": 0}


class _Gate:
    """Stands in for safetensors' save_file: blocks every write until opened, then writes."""

    def __init__(self, monkeypatch) -> None:
        self.open, self.calls, self.real = threading.Event(), [], hf.save_file
        monkeypatch.setattr(hf, "save_file", self)

    def __call__(self, tensors, path, metadata=None) -> None:
        self.calls.append(path)
        assert self.open.wait(timeout=60), "the test never opened the gate"
        self.real(tensors, path, metadata=metadata)


def test_the_next_step_runs_while_the_weights_are_written(model_dir, tmp_path, monkeypatch, make_step_runner):
    model = from_pretrained(model_dir)
    before = {name: t.clone() for name, t in to_hf_state_dict(model).items()}
    runner = make_step_runner(model, lr=1e-2)
    gate = _Gate(monkeypatch)
    publisher = _publisher(tmp_path, model_dir, dtype="float32")
    publisher.publish(model, 1)  # returns with the write blocked in the background
    sum(p.square().sum() for p in model.parameters()).backward()
    runner.optimizer.step()  # the next step changes the weights in place meanwhile
    assert not weights_dir(tmp_path, 1).exists() and stable_steps(tmp_path) == []
    assert len(gate.calls) <= 1
    gate.open.set()
    publisher.wait()
    assert (weights_dir(tmp_path, 1) / STABLE_MARKER).is_file()
    published = to_hf_state_dict(from_pretrained(weights_dir(tmp_path, 1)))
    assert all(torch.equal(published[name], t) for name, t in before.items())  # the snapshot, not the update
    assert not torch.equal(model.lm_head.weight, before["lm_head.weight"])


def test_the_next_publish_waits_for_the_one_in_flight(model_dir, tmp_path, monkeypatch):
    model = from_pretrained(model_dir)
    seen = []
    real = hf.save_file

    def save(tensors, path, metadata=None):
        seen.append((str(path), (weights_dir(tmp_path, 1) / STABLE_MARKER).is_file()))
        real(tensors, path, metadata=metadata)

    monkeypatch.setattr(hf, "save_file", save)
    publisher = _publisher(tmp_path, model_dir)
    publisher.publish(model, 1)
    publisher.publish(model, 2)
    publisher.wait()
    assert [stable for path, stable in seen] == [False, True]
    assert ".step_2." in seen[1][0] and stable_steps(tmp_path) == [1, 2]


def test_a_failed_background_write_is_raised_naming_the_path(model_dir, tmp_path, monkeypatch):
    model = from_pretrained(model_dir)

    def broken(tensors, path, metadata=None):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(hf, "save_file", broken)
    publisher = _publisher(tmp_path, model_dir)
    publisher.publish(model, 1)
    with pytest.raises(
        PublishError,
        match=r"^writing the published weights of step 1 to .*/weights/\.step_1\.\w+/model\.safetensors "
        r"failed: OSError: \[Errno 5\] Input/output error",
    ):
        publisher.wait()
    assert list((tmp_path / "weights").iterdir()) == []
    monkeypatch.undo()
    publisher.publish(model, 1)
    publisher.wait()
    assert stable_steps(tmp_path) == [1]


def test_published_fp8_blocks_are_fp8_on_disk(model_dir, tmp_path):
    from safetensors import safe_open

    path = _published(from_pretrained(model_dir), tmp_path, model_dir, fp8=True, overlap=False)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert f.get_slice("model.layers.1.self_attn.o_proj.weight").get_dtype() == "F8_E4M3"
        assert f.get_tensor("model.layers.1.self_attn.o_proj.weight").dtype == FP8_DTYPE
