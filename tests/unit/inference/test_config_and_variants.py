"""Config parsing for `asyncrl inference`, and the engine on a dense model and in bf16."""

import copy

import pytest
import torch
from inference_helpers import drain, greedy_reference, random_prompts, teacher_logprobs

from asyncrl.config import ConfigError, load_config
from asyncrl.config.inference import InferenceConfig
from asyncrl.inference import SamplingOptions
from asyncrl.inference.main import _kernels_note
from asyncrl.model import Transformer, compute, cpu_norm, preset_args
from asyncrl.model.compute import cpu_kernels, packing_note


def test_cli_flags_and_toml(tmp_path):
    toml = tmp_path / "inf.toml"
    toml.write_text('model = "m"\nport = 9000\nmax_num_seqs = 4\n')
    cfg = load_config(
        InferenceConfig, ["@", str(toml), "--max-num-seqs", "8", "--dtype", "bfloat16", "--api-key", "k"]
    )
    assert (cfg.model, cfg.port, cfg.max_num_seqs, cfg.dtype, cfg.api_key) == ("m", 9000, 8, "bfloat16", "k")
    with pytest.raises(ConfigError, match="max_num_seq"):
        load_config(InferenceConfig, ["--model", "m", "--max-num-seq", "8"])
    with pytest.raises(ConfigError, match="dtype"):
        load_config(InferenceConfig, ["--model", "m", "--dtype", "float64"])


def test_pool_smaller_than_context_is_rejected(make_engine):
    with pytest.raises(ValueError, match="kv_cache_tokens"):
        make_engine(kv_cache_tokens=64, max_model_len=128)


def test_dense_model_greedy_and_zero_routing(make_engine):
    model = Transformer(preset_args("tiny-dense"))
    model.init_weights(seed=1, std=0.05)
    engine = make_engine(model.eval())
    (prompt,) = random_prompts([13], seed=40)
    engine.add_request(
        "d",
        prompt,
        SamplingOptions(temperature=0.0, max_tokens=10, ignore_eos=True),
        return_routed_experts=True,
    )
    res = drain(engine)["d"]
    assert res.tokens == greedy_reference(model, prompt, 10)
    assert res.final.routed_experts.shape == (23, 4, 1) and not res.final.routed_experts.any()


def test_bfloat16_engine_tracks_the_bf16_model(make_engine, tiny_moe):
    model = Transformer(preset_args("tiny-moe"))
    model.load_state_dict(tiny_moe.state_dict())
    model = model.to(torch.bfloat16).eval()
    engine = make_engine(model)
    assert engine.cache.k_LPGd.dtype == torch.bfloat16
    (prompt,) = random_prompts([12], seed=41)
    engine.add_request("b", prompt, SamplingOptions(temperature=1.0, max_tokens=12, ignore_eos=True, seed=0))
    res = drain(engine)["b"]
    ref = teacher_logprobs(model, prompt, res.tokens, 1.0)
    assert (ref - torch.tensor(res.logprobs)).abs().max() < 0.1  # bf16: close, not exact


def test_startup_line_states_the_cpu_bf16_kernels_the_packing_the_decode_attention_matmuls_and_norm(
    make_engine, tiny_moe
):
    engine = make_engine()
    attention = engine.decode_attention_note  # test_cpu_decode.py checks its cases
    matmuls = engine.matmul_kernel_note  # test_cpu_matmul.py these
    norm = cpu_norm.note()  # and tests/unit/model/test_cpu_norm.py this one
    assert attention.startswith("decode attention ") and matmuls.startswith("decode matmuls ")
    assert norm.startswith("RMSNorm ")
    # fp32: no bf16 kernels to state
    assert _kernels_note(engine) == f"; {packing_note()}; {attention}; {matmuls}; {norm}"
    bf16 = make_engine(copy.deepcopy(tiny_moe).bfloat16(), dtype="bfloat16")
    note = _kernels_note(bf16)
    assert (
        note == f"; {cpu_kernels().describe()}; {attention}; {bf16.matmul_kernel_note}; {norm}"
        and "CPU AVX" in note
    )


def test_cpu_packed_weights_false_turns_packing_off_for_the_process(make_engine):
    x = torch.zeros(2, 8)
    try:
        engine = make_engine(cpu_packed_weights=False)
        with torch.inference_mode():
            assert not compute.packs(x, compute.MIN_PACKED)
        assert _kernels_note(engine).startswith("; weights not packed (cpu_packed_weights = false); ")
    finally:
        compute.set_cpu_packing(None)
