"""HFReader: slices of our tensors read from HF files equal slices of the whole, and touch only their
bytes."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncrl.model import ModelConfigError, Transformer, from_pretrained, preset_args, save_pretrained
from asyncrl.model.fp8 import dequantize_weight, quantize_weight
from asyncrl.model.hf import HFReader, load_state_dict

ARGS = replace(preset_args("tiny-moe"), num_hidden_layers=2)
GATE = "model.layers.1.mlp.experts.gate_proj"  # [8, 128, 128]
UP = "model.layers.1.mlp.experts.up_proj"


@pytest.fixture
def saved(tmp_path):
    model = Transformer(ARGS)
    model.init_weights(seed=1)
    save_pretrained(model, tmp_path / "m")
    return tmp_path / "m", model


def _fuse(path) -> None:
    """Rewrite the per-expert tensors in transformers' fused in-memory layout."""
    file = path / "model.safetensors"
    state = load_file(file)
    for layer in range(ARGS.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        stack = {
            proj: torch.stack([state.pop(f"{prefix}.{e}.{proj}.weight") for e in range(ARGS.num_experts)])
            for proj in ("gate_proj", "up_proj", "down_proj")
        }
        state[f"{prefix}.gate_up_proj"] = torch.cat([stack["gate_proj"], stack["up_proj"]], dim=1)
        state[f"{prefix}.down_proj"] = stack["down_proj"]
    save_file(state, file, metadata={"format": "pt"})


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_slices_equal_the_whole_tensor_sliced(saved, layout):
    path, model = saved
    if layout == "fused":
        _fuse(path)
    params = model.state_dict()
    index = (slice(2, 5), slice(32, 96), slice(0, 64))
    with HFReader(path, ARGS) as reader:
        for name in (GATE, UP, "model.layers.0.mlp.experts.down_proj", "model.embed_tokens.weight"):
            got = reader.read(name, torch.float32, index[: params[name].dim()])
            assert torch.equal(got, params[name][index[: params[name].dim()]]), name
        assert reader.read(GATE, torch.float32, (slice(3, 3),)).shape == (0, 128, 128)
    assert torch.equal(load_state_dict(path, ARGS, torch.float32)[UP], params[UP])


def test_a_slice_reads_only_its_bytes(saved):
    path, _ = saved
    with HFReader(path, ARGS) as reader:
        assert reader.bytes_read == 0  # opening reads the headers only
        reader.read(GATE, torch.bfloat16, (slice(2, 4), slice(0, 16)))
        assert reader.bytes_read == 2 * 16 * 128 * 4  # two experts' first 16 rows, fp32 on disk
        reader.read(GATE, torch.float32, (slice(5, 5),))
        assert reader.bytes_read == 2 * 16 * 128 * 4


def test_bf16_files_read_into_the_training_dtype(saved, tmp_path):
    _, model = saved
    save_pretrained(model.to(torch.bfloat16), tmp_path / "bf16")
    with HFReader(tmp_path / "bf16", ARGS) as reader:
        got = reader.read(GATE, torch.float32, (slice(0, 1),))
    assert got.dtype == torch.float32
    assert torch.equal(got, model.state_dict()[GATE][:1].float())


def test_a_wrong_expert_shape_names_the_file_and_tensor(saved):
    path, model = saved
    file = path / "model.safetensors"
    state = load_file(file)
    state["model.layers.1.mlp.experts.6.up_proj.weight"] = torch.zeros(127, 128)
    save_file(state, file, metadata={"format": "pt"})
    expected = {n: t.shape for n, t in model.state_dict().items()}
    with HFReader(path, ARGS) as reader, pytest.raises(ModelConfigError) as e:
        reader.check(expected, where=str(path))
    assert str(e.value) == (
        f"{file}: tensor 'model.layers.1.mlp.experts.6.up_proj.weight' has shape [127, 128], expected [128, "
        "128]"
    )
    with pytest.raises(ModelConfigError, match=r"'model.layers.1.mlp.experts.6.up_proj.weight' has shape"):
        from_pretrained(path)


def test_experts_beyond_the_config_and_integer_tensors_are_rejected(saved):
    path, _ = saved
    file = path / "model.safetensors"
    state = load_file(file)
    save_file(state | {"model.layers.0.mlp.experts.8.up_proj.weight": torch.zeros(128, 128)}, file)
    with pytest.raises(ModelConfigError, match=r"unexpected tensors \['model.layers.0.mlp.experts.8.up_proj"):
        HFReader(path, ARGS)
    save_file(state | {"model.norm.weight": torch.ones(128, dtype=torch.int64)}, file)
    with pytest.raises(
        ModelConfigError, match=r"'model.norm.weight' has dtype I64; weights must be floating"
    ):
        HFReader(path, ARGS)


def _fp8_checkpoint(saved, tmp_path, name: str, edit=None):
    """The saved checkpoint with `name` (one expert's or a plain 2-D weight) stored as block-scale FP8."""
    path, _ = saved
    state = load_file(path / "model.safetensors")
    q, scale = quantize_weight(state[name])
    state[name], state[name + "_scale_inv"] = q, scale
    if edit:
        edit(state)
    out = tmp_path / "fp8"
    out.mkdir()
    (out / "config.json").write_text((path / "config.json").read_text())
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out, dequantize_weight(q, scale)


def test_fp8_block_weights_read_dequantized_whole_or_by_slice(saved, tmp_path):
    path, whole = _fp8_checkpoint(saved, tmp_path, "model.layers.1.mlp.experts.3.gate_proj.weight")
    with HFReader(path, ARGS) as reader:
        assert GATE in reader.names and not any(n.endswith("_scale_inv") for n in reader.names)
        assert torch.equal(reader.read(GATE, torch.float32)[3], whole)
        before = reader.bytes_read
        part = reader.read(GATE, torch.float32, (slice(3, 4), slice(40, 100), slice(10, 70)))
        assert torch.equal(part[0], whole[40:100, 10:70])  # a slice off the block grid
        assert reader.bytes_read - before == 60 * 60 * 1 + 4  # FP8 bytes of the slice + its one scale
        assert torch.equal(reader.read(GATE, torch.bfloat16, (slice(3, 4),))[0], whole.bfloat16())


def test_fp8_without_its_scales_or_scales_without_a_weight_are_named(saved, tmp_path):
    name = "model.layers.0.self_attn.o_proj.weight"
    lone = tmp_path / "lone"
    lone.mkdir()
    path, _ = _fp8_checkpoint(saved, lone, name, edit=lambda s: s.pop(name + "_scale_inv"))
    with pytest.raises(ModelConfigError, match=f"FP8 tensor '{name}' has no block scales"):
        HFReader(path, ARGS)
    orphan = tmp_path / "orphan"
    orphan.mkdir()
    path, _ = _fp8_checkpoint(
        saved,
        orphan,
        name,
        edit=lambda s: s.__setitem__("x.weight_scale_inv", s[name + "_scale_inv"].clone()),
    )
    with pytest.raises(
        ModelConfigError, match="block scales 'x.weight_scale_inv' without their weight 'x.weight'"
    ):
        HFReader(path, ARGS)
