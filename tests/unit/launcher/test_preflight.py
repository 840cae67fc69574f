"""`asyncrl rl` checks every input (model, tokenizer, envs, vLLM interpreter) before it starts a process."""

from __future__ import annotations

import shutil

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.config.rl import RLConfig
from asyncrl.launcher import rl
from asyncrl.launcher.preflight import check_inputs
from asyncrl.tools.init_model import init_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny-moe"
    init_model("tiny-moe", path, seed=0)
    return path


@pytest.fixture
def no_processes(monkeypatch):
    """`asyncrl rl` may resolve and check, but starting a process fails the test."""
    monkeypatch.setattr(rl, "Supervisor", lambda *a, **k: pytest.fail("asyncrl rl started its processes"))


def _rl(model, tmp_path, *extra: str) -> int:
    return rl.main(["--model", str(model), "--run-dir", str(tmp_path / "run"), *extra])


def _resolved(model, **sections):
    return load_config(RLConfig, {"model": str(model)} | sections).resolve()


def test_a_missing_model_directory_stops_the_launch_before_any_process(tmp_path, capsys, no_processes):
    missing = tmp_path / "sft" / "weights" / "step_300"
    assert _rl(missing, tmp_path) == 2
    err = capsys.readouterr().err
    assert f"asyncrl rl: model = '{missing}': no such directory" in err
    assert not (tmp_path / "run" / "logs").exists()


def test_a_model_without_weights_or_tokenizer_is_refused(tiny_model, tmp_path, capsys, no_processes):
    no_weights = tmp_path / "no-weights"
    shutil.copytree(tiny_model, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    assert _rl(no_weights, tmp_path) == 2
    assert f"model = '{no_weights}': no *.safetensors weights" in capsys.readouterr().err

    no_tokenizer = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_model, no_tokenizer, ignore=shutil.ignore_patterns("tokenizer*", "*.jinja"))
    assert _rl(no_tokenizer, tmp_path) == 2
    assert f"model = '{no_tokenizer}': its tokenizer does not load" in capsys.readouterr().err


def test_env_arguments_and_task_files_are_checked(tiny_model, tmp_path):
    bad_arg = {"name": "reverse-text", "args": {"max_length": 5}}
    with pytest.raises(
        ConfigError, match=r"envs\[0\] \(name = 'reverse-text'\): .*bad args \['max_length'\]"
    ):
        check_inputs(_resolved(tiny_model, orchestrator={"envs": {"envs": [bad_arg]}}))
    missing = tmp_path / "qa.jsonl"
    dataset = {"name": "dataset", "args": {"data": {"path": str(missing), "prompt_field": "q"}}}
    with pytest.raises(ConfigError, match=r"envs\[0\] \(name = 'dataset'\): .*qa\.jsonl"):
        check_inputs(_resolved(tiny_model, orchestrator={"envs": {"envs": [dataset]}}))


def test_a_missing_vllm_interpreter_is_named(tiny_model, tmp_path):
    python = tmp_path / "venv" / "bin" / "python"
    resolved = _resolved(tiny_model, inference={"backend": "vllm", "vllm": {"python": str(python)}})
    with pytest.raises(ConfigError, match=rf"\[inference.vllm\] python = '{python}' is not an executable"):
        check_inputs(resolved)


def test_the_demo_inputs_pass(tiny_model):
    demo_env = {"name": "reverse-text", "args": {"min_len": 3, "max_len": 5}}
    check_inputs(_resolved(tiny_model, orchestrator={"envs": {"envs": [demo_env]}}))
