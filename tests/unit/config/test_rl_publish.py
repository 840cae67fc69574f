"""The trainer publishes what the servers serve: `[trainer.publish]`'s format comes from `[inference]`."""

from __future__ import annotations

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.config.rl import RLConfig
from asyncrl.config.trainer import RLTrainerConfig, SFTConfig


def _rl(**kw) -> RLConfig:
    return load_config(RLConfig, {"model": "m", "run_dir": "r", "max_steps": 5} | kw)


def test_exact_mode_servers_get_float32_weights():
    publish = _rl(trainer={"publish": {"keep_last": 2}}).resolve().trainer.publish
    assert (publish.dtype, publish.fp8, publish.keep_last) == ("float32", False, 2)


def test_bf16_and_fp8_servers_get_their_format():
    inference = {"dtype": "bfloat16", "fp8": {"enabled": True, "ignore": ["lm_head", "*.o_proj"]}}
    publish = _rl(inference=inference).resolve().trainer.publish
    assert (publish.dtype, publish.fp8, publish.fp8_ignore) == ("bfloat16", True, ["lm_head", "*.o_proj"])


@pytest.mark.parametrize(
    ("key", "source"),
    [
        ("dtype", r"\[inference\] dtype"),
        ("fp8", r"\[inference\] fp8.enabled"),
        ("fp8_ignore", r"\[inference\] fp8.ignore"),
    ],
)
def test_the_trainer_section_cannot_set_the_format_itself(key, source):
    value = {"dtype": "bfloat16", "fp8": True, "fp8_ignore": []}[key]
    with pytest.raises(ConfigError, match=rf"'trainer': sets publish.{key} \(from {source}\)"):
        _rl(trainer={"publish": {key: value}})


def test_standalone_defaults_bf16_for_the_rl_trainer_and_float32_for_sft(tmp_path):
    rl = load_config(RLTrainerConfig, {"model": {"path": "m"}, "max_steps": 1})
    sft = load_config(SFTConfig, {"model": {"path": "m"}, "max_steps": 1, "data": {"path": "d.jsonl"}})
    assert (rl.publish.dtype, rl.publish.fp8, rl.publish.overlap) == ("bfloat16", False, True)
    assert sft.publish.dtype == "float32"
