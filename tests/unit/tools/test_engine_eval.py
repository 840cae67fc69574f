"""`asyncrl eval`: held-out tasks through the in-process engine and the orchestrator's episode loop."""

from __future__ import annotations

import json

import pytest

from asyncrl.config.envs import EnvConfig
from asyncrl.config.sampling import SamplingParams
from asyncrl.inference.engine import Engine
from asyncrl.tools.engine_eval import evaluate, main
from asyncrl.tools.init_model import init_model


def test_eval_scores_every_task_and_greedy_is_deterministic(tmp_path):
    init_model("tiny-moe", tmp_path / "model", seed=0)
    env = EnvConfig(name="reverse-text", args={"max_len": 4})
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    a = evaluate(str(tmp_path / "model"), env, num=6, sampling=greedy)
    b = evaluate(str(tmp_path / "model"), env, num=6, sampling=greedy)
    assert a.num_tasks == 6 and a.num_failed == 0
    assert 0.0 <= a.reward <= 1.0 and set(a.rewards) == {"lcs", "exact"}
    assert a.reward == b.reward and a.examples == b.examples
    assert a.examples[0]["prompt"].startswith("reverse: ")


def test_main_writes_one_json_line_per_temperature(tmp_path, capsys):
    init_model("tiny-moe", tmp_path / "model", seed=0)
    out = tmp_path / "eval.jsonl"
    argv = ["--model", str(tmp_path / "model"), "--env", "reverse-text", "--num", "3", "--max-tokens", "4"]
    assert main([*argv, "--temperature", "0", "1", "--label", "base", "--json-out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["label"], r["temperature"], r["num_tasks"]) for r in rows] == [
        ("base", 0.0, 3),
        ("base", 1.0, 3),
    ]
    assert "eval base (temperature 0): reward" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no config.json"):
        main(["--model", str(tmp_path), "--env", "reverse-text"])


class _Built(Exception):
    """Raised by a stand-in engine build: the test needs only the config it was given."""


def test_the_engine_runs_on_the_device_asked_for(tmp_path, monkeypatch):
    init_model("tiny-moe", tmp_path / "model", seed=0)
    seen = []

    def build(cfg, **kwargs):
        seen.append(cfg.device)
        raise _Built

    monkeypatch.setattr(Engine, "from_config", build)
    argv = ["--model", str(tmp_path / "model"), "--env", "reverse-text", "--num", "1"]
    for extra, device in (([], "auto"), (["--device", "cpu"], "cpu")):
        with pytest.raises(_Built):
            main([*argv, *extra])
        assert seen.pop() == device
    with pytest.raises(SystemExit):
        main([*argv, "--device", "gpu"])
