"""Sharded start-up at world size 2 and 4 gives exactly the weights of a one-process load.

Each rank builds the model on meta, parallelises it and reads only its own slices of the HF
safetensors files (asyncrl.distributed.load_hf_shards, through the trainer's
build_parallel_model). For every family, and for FSDP, EP (with activation checkpointing), CP and
HSDP layouts, the gathered state dict must equal `from_pretrained`'s bit for bit, a forward must
give its logits, and each rank must have read exactly the bytes it holds (about 1/N of the files
plus the routers' small replicated biases). GLM-5's MTP layer is frozen, sharded, published and
checkpointed.
"""

from __future__ import annotations

from dataclasses import replace

import dist_workers as W
import load_workers as L
import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncrl.distributed import load_dcp
from asyncrl.model import Transformer, from_pretrained, preset_args, save_pretrained
from asyncrl.run_dir import weights_dir
from asyncrl.tools.init_model import init_model

FAMILIES = ("tiny-moe", "tiny-dense", "tiny-glm4moe", "tiny-dsv3", "tiny-glm5")


def _fuse_experts(path) -> None:
    """Rewrite a Qwen3-MoE checkpoint in transformers' fused expert layout (gate_up_proj, down_proj)."""
    file = path / "model.safetensors"
    state, args = load_file(file), preset_args("tiny-moe")
    for layer in range(args.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        stack = {
            p: torch.stack([state.pop(f"{prefix}.{e}.{p}.weight") for e in range(args.num_experts)])
            for p in ("gate_proj", "up_proj", "down_proj")
        }
        state[f"{prefix}.gate_up_proj"] = torch.cat([stack["gate_proj"], stack["up_proj"]], dim=1)
        state[f"{prefix}.down_proj"] = stack["down_proj"]
    save_file(state, file, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    dirs = {}
    for seed, preset in enumerate(FAMILIES):
        init_model(preset, root / preset, seed=seed)
        dirs[preset] = str(root / preset)
    init_model("tiny-moe", root / "fused", seed=7)
    _fuse_experts(root / "fused")
    dirs["tiny-moe fused experts"] = str(root / "fused")
    tied = Transformer(replace(preset_args("tiny-dense"), tie_word_embeddings=True))
    tied.init_weights(seed=8)
    save_pretrained(tied, root / "tied")
    dirs["tiny-dense tied"] = str(root / "tied")
    return dirs


def test_two_ranks_load_exactly_the_one_process_weights(model_dirs):
    # (CP at 2 ranks shards weights exactly as FSDP 2 does; the 4-rank test runs FSDP2 x CP2 x EP2.)
    layouts = [({"dp_shard": 2}, False), ({"dp_shard": 2, "ep": 2}, True)]
    W.launch(L.worker_startup, 2, model_dirs, layouts)


def test_four_ranks_load_exactly_the_one_process_weights(model_dirs):
    layouts = [
        ({"dp_shard": 4, "ep": 2}, False),  # experts: EP2 x FSDP2 on dim 1
        ({"dp_shard": 4, "ep": 4}, False),  # two whole experts per rank
        ({"dp_shard": 2, "cp": 2, "ep": 2}, True),
        ({"dp_replicate": 2, "dp_shard": 2, "ep": 2}, False),  # HSDP: replicas read the same shards
    ]
    some = {k: model_dirs[k] for k in ("tiny-glm5", "tiny-moe")}  # every family ran at 2 ranks
    W.launch(L.worker_startup, 4, some, layouts)


def test_glm5_mtp_layer_is_frozen_published_and_checkpointed_at_two_ranks(model_dirs, tmp_path):
    source = model_dirs["tiny-glm5"]
    run_dir, dcp_dir = tmp_path / "run", tmp_path / "dcp"
    W.launch(L.worker_mtp_publish, 2, source, str(run_dir), str(dcp_dir))

    original = load_file(f"{source}/model.safetensors")
    mtp = {k: t for k, t in original.items() if k.startswith("model.layers.4.")}
    published = {}
    for file in weights_dir(run_dir, 1).glob("*.safetensors"):
        published |= load_file(file)
    assert published.keys() == original.keys()
    for key, t in mtp.items():
        assert torch.equal(published[key], t), key
    trained = "model.layers.1.self_attn.o_proj.weight"
    assert not torch.equal(published[trained], original[trained])  # the step did train the weights
    assert from_pretrained(weights_dir(run_dir, 1)).mtp.get_buffer("model:layers:4:eh_proj:weight").shape == (
        128,
        256,
    )

    one = from_pretrained(source)  # resume at world size 1 from the 2-rank DCP checkpoint
    for b in one.mtp.buffers():
        b.zero_()
    load_dcp(dcp_dir, one)
    resumed = dict(one.mtp.items())
    for key, t in mtp.items():
        assert torch.equal(resumed[key], t), key
