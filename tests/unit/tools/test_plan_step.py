"""The RL step's arithmetic: a version's bytes in bf16 and FP8 blocks, the rollouts, the overlap."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from asyncrl.model import Transformer, preset_args
from asyncrl.model.args import ModelArgs
from asyncrl.model.hf import plan_files
from asyncrl.model.serving import serving_format
from asyncrl.tools.plan import main
from asyncrl.tools.plan_step import RLInputs, RLStepError, build_step, version_bytes
from asyncrl.tools.plan_trainer import Layout

GLM5 = Path(__file__).resolve().parents[3] / "docs" / "configs" / "glm5.json"


def _qwen3(**shapes: int) -> ModelArgs:
    cfg = {"model_type": "qwen3", "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
           "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128}  # fmt: skip
    return ModelArgs.from_hf_config(cfg | shapes)


def test_a_version_is_two_bytes_per_parameter_in_bf16_and_fp8_blocks_where_dims_allow():
    args = _qwen3()
    assert version_bytes(args, "bf16") == 2 * args.num_params()
    assert version_bytes(args, "fp32") == 4 * args.num_params()
    # FP8: q/k/v, o, gate/up, down as e4m3 with one fp32 scale per 128x128 block; embeddings,
    # LM head (kept high precision for vLLM) and norms in bf16
    fp8 = {(256, 256): 2 * 2, (128, 256): 1 * 2, (512, 256): 4 * 2, (256, 512): 2 * 4}  # blocks
    linears = [(256, 256), (128, 256), (128, 256), (256, 256), (512, 256), (512, 256), (256, 512)]
    fp8_bytes = sum(o * k + 4 * fp8[(o, k)] for o, k in linears)
    rest = 2 * (2 * 1000 * 256 + 2 * 128 + 3 * 256)
    assert version_bytes(args, "fp8") == fp8_bytes + rest


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-glm5"])
def test_version_bytes_are_what_the_publishers_file_plan_holds(preset):
    args = preset_args(preset)
    with torch.device("meta"):
        model = Transformer(args)
    # the file plan of a model built from a config has no MTP tensors (a checkpoint brings them)
    without_mtp = replace(args, extra={})
    for dtype in ("bf16", "fp8"):
        fmt = serving_format(model, torch.bfloat16, fp8=dtype == "fp8")
        assert version_bytes(without_mtp, dtype) == plan_files(model, fmt=fmt).total_bytes


def _step(**over) -> tuple[Layout, RLInputs]:
    layout = Layout(nodes=1, gpus_per_node=1, seq_len=256)
    inputs = RLInputs(
        inference_nodes=1, rollouts=8, prompt_tokens=0, completion_tokens=100, decode_tok_s=100.0,
        prefill_tok_s=1000.0, fs_write_gbps=1e-3, fs_read_gbps=1e-3,
    )  # fmt: skip
    return layout, replace(inputs, **over)


def test_rollouts_take_the_servers_work_or_one_rollouts_decode_whichever_is_longer():
    args = preset_args("tiny-moe")
    step = build_step(args, *_step(max_async_steps=1))
    assert step.inference.batch == 16  # two batches in flight on the one server
    assert step.throughput_s == pytest.approx(8 * 100 / 100)  # 800 tokens at 100 tok/s
    assert step.latency_s == pytest.approx(100 * 16 / 100)  # 100 steps of a 16-sequence batch
    assert step.rollout_s == step.latency_s
    prompt = build_step(args, *_step(prompt_tokens=50))
    assert prompt.throughput_s == pytest.approx(8 + 8 * 50 / 1000)


def test_overlap_makes_the_step_the_largest_side_and_synchronous_the_sum():
    args = preset_args("tiny-moe")
    v = version_bytes(args, "bf16")
    sync = build_step(args, *_step(max_async_steps=0))
    write, read = v / 1e6, v / 1e6  # 1 MB/s both ways, one server
    assert (sync.write_s, sync.read_s) == (pytest.approx(write), pytest.approx(read))
    assert sync.bound == "pipeline"
    assert sync.step_s == pytest.approx(sync.trainer_s + write + read + sync.rollout_s)
    overlapped = build_step(args, *_step(max_async_steps=4))
    assert overlapped.bound == "rollouts"  # the servers' work of one batch plus their reload
    assert overlapped.step_s == pytest.approx(overlapped.throughput_s + read)
    slow_trainer = build_step(args, *_step(max_async_steps=4, fs_write_gbps=1e-5))
    assert slow_trainer.bound == "trainer" and slow_trainer.step_s == pytest.approx(v / 1e4)


def test_rl_step_inputs_that_cannot_run_are_named():
    args = preset_args("tiny-moe")
    with pytest.raises(RLStepError, match=r"--servers-per-node \(3\) must divide --gpus-per-node \(8\)"):
        build_step(args, Layout(nodes=1, gpus_per_node=8, seq_len=256), _step(servers_per_node=3)[1])
    with pytest.raises(RLStepError, match="a rollout of 300 tokens .* longer than --seq-len \\(256\\)"):
        build_step(args, *_step(prompt_tokens=200))
    with pytest.raises(RLStepError, match="--serve-dtype must be one of"):
        build_step(args, *_step(serve_dtype="int4"))


def test_cli_plans_the_reference_step_and_names_bad_flags(capsys):
    at = ["--model", str(GLM5), "--nodes", "20", "--seq-len", "131072", "--ep", "8", "--cp", "8"]
    rl = [
        "--inference-nodes",
        "8",
        "--rollouts",
        "256",
        "--prompt-tokens",
        "32768",
        "--completion-tokens",
        "16384",
    ]
    assert main([*at, *rl, "--serve-dtype", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "largest all-gathered layer" in out  # the trainer's plan comes first, as without RL flags
    assert "RL step: 20 trainer + 8 inference nodes (8 server(s) of 8 GPUs)" in out
    assert "767.3 GB per version in fp8" in out and "bound by the trainer" in out
    assert main([*at, *rl]) == 2  # GLM-5 in bf16 (1.5 TB) does not fit one 8 x H200 server
    assert "serve in fp8 (--serve-dtype fp8)" in capsys.readouterr().err
    assert main([*at, "--rollouts", "256"]) == 2
    assert "--rollouts belong to the RL step: give --inference-nodes too" in capsys.readouterr().err
    assert main([*at, "--inference-nodes", "8", "--rollouts", "256"]) == 2
    assert "needs --prompt-tokens, --completion-tokens" in capsys.readouterr().err


def test_an_rl_config_gives_the_same_step_as_its_flags(tmp_path, capsys):
    model = tmp_path / "glm5"
    model.mkdir()
    (model / "config.json").write_text(GLM5.read_text())
    toml = tmp_path / "rl.toml"
    toml.write_text(
        f'model = "{model}"\nseq_len = 131072\n'
        '[inference]\ndtype = "bfloat16"\nfp8 = { enabled = true }\n'
        "[orchestrator]\nbatch_size = 256\ngroup_size = 8\n"
        "[trainer.parallel]\nep = 8\ncp = 8\nactivation_checkpointing = true\n"
        "[slurm]\ninference_nodes = 8\ntrainer_nodes = 20\n"
    )
    tokens = ["--prompt-tokens", "40960", "--completion-tokens", "8192"]
    assert main(["--config", str(toml), *tokens]) == 0
    from_config = capsys.readouterr().out
    at = ["--model", str(GLM5), "--nodes", "20", "--seq-len", "131072", "--ep", "8", "--cp", "8"]
    rl = ["--inference-nodes", "8", "--rollouts", "256", "--serve-dtype", "fp8"]
    assert main([*at, *rl, *tokens]) == 0
    assert from_config == capsys.readouterr().out
    # a flag overrides the file; a key the file must not have is named
    assert main(["--config", str(toml), *tokens, "--inference-nodes", "4"]) == 0
    assert "20 trainer + 4 inference nodes" in capsys.readouterr().out
    toml.write_text(toml.read_text() + "[orchestrator.nope]\n")
    assert main(["--config", str(toml), *tokens]) == 2
    assert "nope" in capsys.readouterr().err
