"""Config combinations that each process would accept and then fail on, or train badly with, are
rejected at start, by `asyncrl rl`'s resolve() and by the standalone orchestrator's config, with a
message that names both keys and both numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.config.orchestrator import OrchestratorConfig
from asyncrl.config.rl import RLConfig
from asyncrl.launcher.slurm import SlurmRLConfig

EXAMPLES = Path(__file__).parents[3] / "examples" / "reverse_text"


def _rl(**kw) -> RLConfig:
    return load_config(RLConfig, {"model": "m", "run_dir": "r"} | kw)


def _env(**kw) -> dict:
    return {"envs": {"envs": [{"name": "reverse-text"} | kw]}}


def _model_dir(tmp_path: Path, max_position_embeddings: int) -> str:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": max_position_embeddings}))
    return str(tmp_path)


def test_the_defaults_agree():
    resolved = _rl().resolve()
    env = resolved.orchestrator.envs.envs[0]
    assert env.max_total_tokens <= resolved.trainer.seq_len == resolved.orchestrator.seq_len


def test_an_episode_budget_over_seq_len_is_rejected():
    with pytest.raises(ConfigError, match=r"max_total_tokens \(2048\) is larger than seq_len \(1024\)"):
        _rl(seq_len=1024).resolve()
    with pytest.raises(
        ConfigError, match=r"envs\.envs\[0\] \(rev\) max_total_tokens \(3000\) is larger than seq_len"
    ):
        _rl(orchestrator=_env(label="rev", max_total_tokens=3000)).resolve()
    resolved = _rl(seq_len=1024, orchestrator=_env(max_total_tokens=1024)).resolve()
    assert resolved.orchestrator.seq_len == resolved.trainer.seq_len == 1024
    # The standalone orchestrator knows seq_len from its own config (the trainer's default otherwise).
    with pytest.raises(ValueError, match=r"max_total_tokens \(600\) is larger than seq_len \(512\)"):
        OrchestratorConfig(model="m", seq_len=512, **_env(max_total_tokens=600))
    with pytest.raises(ValueError, match=r"max_total_tokens \(4096\) is larger than seq_len \(2048\)"):
        OrchestratorConfig(model="m", **_env(max_total_tokens=4096))


def test_an_episode_budget_over_the_servers_context_is_rejected(tmp_path):
    model = _model_dir(tmp_path, max_position_embeddings=1024)
    with pytest.raises(ConfigError, match=r"max_total_tokens \(2048\) is larger than max_model_len \(1024\)"):
        _rl(model=model).resolve()  # the model's max_position_embeddings
    with pytest.raises(ConfigError, match=r"max_total_tokens \(2048\) is larger than max_model_len \(512\)"):
        _rl(inference={"max_model_len": 512}).resolve()  # the servers' own limit, whatever the model's
    vllm = {"backend": "vllm", "max_model_len": 1500}
    with pytest.raises(ConfigError, match=r"max_total_tokens \(2048\) is larger than max_model_len \(1500\)"):
        _rl(inference=vllm).resolve()
    fits = _rl(model=model, orchestrator=_env(max_total_tokens=1024)).resolve()
    assert fits.orchestrator.max_model_len == 1024  # the orchestrator caps requests by it
    assert _rl().resolve().orchestrator.max_model_len is None  # no config.json yet: unknown
    with pytest.raises(ValueError, match=r"max_total_tokens \(2048\) is larger than max_model_len \(256\)"):
        OrchestratorConfig(model="m", max_model_len=256)


def test_vllm_extra_args_cannot_set_the_context_limit_behind_the_check():
    for args in (["--max-model-len", "4096"], ["--max_model_len=4096"]):
        with pytest.raises(
            ConfigError, match=r"extra_args sets --max.model.len: set \[inference\] max_model_len"
        ):
            _rl(inference={"backend": "vllm", "vllm": {"extra_args": args}}).resolve()


def test_a_publish_interval_the_orchestrator_cannot_wait_for_is_rejected():
    with pytest.raises(
        ConfigError, match=r"interval \(3\) is larger than \[orchestrator\] max_async_steps \+ 1 \(2\)"
    ):
        _rl(trainer={"publish": {"interval": 3}}).resolve()
    lag = {"max_async_steps": 2, "max_off_policy_steps": 2}
    assert _rl(trainer={"publish": {"interval": 3}}, orchestrator=lag).resolve().trainer.publish.interval == 3
    with pytest.raises(ConfigError, match=r"interval \(2\) is larger than .* max_async_steps \+ 1 \(1\)"):
        _rl(trainer={"publish": {"interval": 2}}, orchestrator={"max_async_steps": 0}).resolve()


def test_async_steps_beyond_the_off_policy_bound_are_rejected():
    match = r"max_async_steps \(2\) is larger than max_off_policy_steps \(1\)"
    with pytest.raises(ConfigError, match=match):
        _rl(orchestrator={"max_async_steps": 2, "max_off_policy_steps": 1}).resolve()
    with pytest.raises(ValueError, match=match):
        OrchestratorConfig(model="m", max_async_steps=2, max_off_policy_steps=1)
    assert OrchestratorConfig(model="m", max_async_steps=1, max_off_policy_steps=3).max_async_steps == 1


@pytest.mark.parametrize("files", [["rl.toml"], ["rl.toml", "rl-vllm.toml"]])
def test_the_example_configs_resolve(tmp_path, files):
    argv = [a for f in files for a in ("@", str(EXAMPLES / f))]
    cfg = load_config(SlurmRLConfig, [*argv, "--model", _model_dir(tmp_path, 4096)])
    resolved = cfg.resolve()
    env = resolved.orchestrator.envs.envs[0]
    assert env.max_total_tokens <= min(resolved.trainer.seq_len, resolved.orchestrator.max_model_len)
