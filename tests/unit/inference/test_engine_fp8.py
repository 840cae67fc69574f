"""FP8 inference: `[fp8] enabled` quantizes the engine's model, and its logprobs are those of the
same FP8 model in `asyncrl.model` (so a matched FP8 trainer sees no precision mismatch)."""

import copy

import torch
from inference_helpers import drain, random_prompts, teacher_logprobs

from asyncrl.config.inference import InferenceConfig
from asyncrl.inference import Engine, SamplingOptions
from asyncrl.launcher.init_model import init_model
from asyncrl.model import from_pretrained
from asyncrl.model.fp8 import FP8Linear, apply_fp8


def test_fp8_engine_matches_fp8_model_and_differs_from_fp32(tmp_path, tiny_moe):
    path = tmp_path / "m"
    init_model("tiny-moe", path, seed=5)
    engine = Engine.from_config(
        InferenceConfig(
            model=str(path), block_size=4, kv_cache_tokens=4096, fp8={"enabled": True, "backend": "emulated"}
        )
    )
    assert isinstance(engine.model.model.layers[0].self_attn.q_proj, FP8Linear)
    (prompt,) = random_prompts([12], seed=4)
    engine.add_request("a", prompt, SamplingOptions(temperature=1.0, max_tokens=10, ignore_eos=True, seed=1))
    res = drain(engine)["a"]
    fp8_model = from_pretrained(path)
    apply_fp8(fp8_model, backend="emulated")
    ref_fp8 = teacher_logprobs(fp8_model, prompt, res.tokens, 1.0)
    ref_fp32 = teacher_logprobs(from_pretrained(path), prompt, res.tokens, 1.0)
    got = torch.tensor(res.logprobs)
    assert (ref_fp8 - got).abs().max() <= 1e-5
    assert (ref_fp32 - got).abs().max() > 1e-4  # quantization is really on


def test_fp8_off_by_default(make_engine):
    engine = make_engine()
    assert not any(isinstance(m, FP8Linear) for m in engine.model.modules())
    assert copy.deepcopy(InferenceConfig(model="m")).fp8.enabled is False
