"""`asyncrl plan`: the seed's all-gather figure, the documented GLM-5-scale layout, warnings and errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.distributed import ParallelDimsError
from asyncrl.launcher.plan import GB, Layout, build_plan, load_model_config, main

DOCS = Path(__file__).resolve().parents[3] / "docs" / "configs"
SEED = DOCS / "seed-800b-78l.json"
GLM5 = DOCS / "glm5-scale-moe.json"


def test_seed_figure_one_fp32_layer_is_40gb_and_80gb_with_prefetch():
    args = load_model_config(SEED)
    assert args.num_hidden_layers == 78 and 780e9 < args.num_params() < 830e9
    plan = build_plan(args, Layout(nodes=28, gpus_per_node=8, seq_len=8192, param_dtype="fp32"))
    assert 38 < plan.gathered_layer / GB < 44
    assert 76 < plan.gathered_with_prefetch / GB < 88
    # EP sends tokens instead: each rank gathers only its 1/8 of a layer's experts.
    with_ep = build_plan(args, Layout(nodes=28, gpus_per_node=8, seq_len=8192, param_dtype="fp32", ep=8))
    assert with_ep.gathered_layer < plan.gathered_layer / 6
    assert with_ep.all_to_all_bytes > 0 == plan.all_to_all_bytes


def test_sharded_state_is_16_bytes_per_parameter_over_dp_shard_times_cp():
    args = load_model_config(GLM5)
    plan = build_plan(args, Layout(nodes=28, gpus_per_node=8, seq_len=65536, ep=8, cp=2))
    assert plan.dims.dp_shard == 112
    per_gpu = plan.params + plan.grads + plan.optimizer
    assert per_gpu == pytest.approx(16 * args.num_params() / 224)


def test_documented_glm5_scale_layout_fits_and_checkpointing_matters():
    args = load_model_config(GLM5)
    plan = build_plan(args, Layout(nodes=28, gpus_per_node=8, seq_len=65536, ep=8, cp=2))
    assert plan.fits and plan.total < 141 * GB
    assert plan.activations_ac < plan.activations_no_ac / 10
    no_cp = build_plan(args, Layout(nodes=28, gpus_per_node=8, seq_len=65536, ep=8, cp=1))
    assert not no_cp.fits  # the whole 64k row on one GPU does not fit: CP is what makes it fit


def test_cli_prints_the_table_and_warns_with_exit_1(capsys):
    assert main(["--model", str(GLM5), "--nodes", "28", "--seq-len", "65536", "--ep", "8", "--cp", "2"]) == 0
    out = capsys.readouterr().out
    assert "largest all-gathered layer" in out and "all_to_all sent per GPU per step" in out
    assert main(["--model", str(SEED), "--nodes", "28", "--seq-len", "16384", "--param-dtype", "fp32"]) == 1
    assert "WARNING: does not fit" in capsys.readouterr().out


def test_bad_layouts_name_the_constraint(tmp_path, capsys):
    assert main(["--model", str(GLM5), "--nodes", "2", "--seq-len", "4096", "--ep", "3"]) == 2
    assert "ep (3) must divide num_experts (256)" in capsys.readouterr().err
    with pytest.raises(ParallelDimsError, match=r"seq_len \(1000\) must be a multiple of cp \(3\)"):
        build_plan(load_model_config(GLM5), Layout(nodes=3, gpus_per_node=1, seq_len=1000, cp=3))
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"model_type": "llama"}))
    assert main(["--model", str(tmp_path), "--nodes", "1", "--seq-len", "8"]) == 2
    assert "--model" in capsys.readouterr().err
