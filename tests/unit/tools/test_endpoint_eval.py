"""`asyncrl eval-env`: an environment evaluated against an OpenAI-compatible endpoint (mock server)."""

from __future__ import annotations

import json

import httpx
import pytest

from asyncrl.envs import build_env
from asyncrl.launcher.cli import main as cli_main
from asyncrl.tools import endpoint_eval


def test_eval_env_command_on_a_mock_server(capsys, monkeypatch):
    def handler(request: httpx.Request) -> httpx.Response:
        prompt = json.loads(request.content)["messages"][-1]["content"]
        word = prompt.removeprefix("reverse: ")
        answer = word[::-1] if len(word) % 2 else word  # right on odd lengths only
        return httpx.Response(
            200, json={"choices": [{"message": {"content": answer}, "finish_reason": "stop"}]}
        )

    real_client = httpx.AsyncClient
    monkeypatch.setattr(
        endpoint_eval.httpx,
        "AsyncClient",
        lambda **kw: real_client(transport=httpx.MockTransport(handler), **kw),
    )
    assert cli_main(["eval-env", "--base-url", "http://srv", "--env", "reverse-text", "--num", "20"]) == 0
    out = capsys.readouterr().out
    env = build_env("reverse-text")
    words = [env.task("eval", i).answer for i in range(20)]
    expected_exact = sum(len(w) % 2 == 1 for w in words) / 20
    rows = dict(line.split() for line in out.splitlines()[1:])
    assert float(rows["rewards/exact"]) == pytest.approx(expected_exact, abs=1e-4)
    assert float(rows["num_episodes"]) == 20
    assert "metrics/num_turns" in out and "reverse-text (eval, 20 episodes)" in out


@pytest.mark.parametrize(("agent", "reward"), [("reference", 1.0), ("noop", 0.0)])
def test_eval_env_scripted_agents_need_no_server(capsys, agent, reward):
    assert cli_main(["eval-env", "--agent", agent, "--env", "reverse-text", "--num", "6"]) == 0
    out = capsys.readouterr().out
    rows = dict(line.split() for line in out.splitlines()[1:])
    assert float(rows["reward"]) == reward and float(rows["reward_min"]) == reward
    assert float(rows["num_episodes"]) == 6 and f"[agent: {agent}]" in out


def test_eval_env_with_a_model_needs_a_base_url(capsys):
    with pytest.raises(SystemExit):
        endpoint_eval.main(["--env", "reverse-text"])
    assert "--agent model (the default) evaluates a served model: pass --base-url" in capsys.readouterr().err
