"""`asyncrl eval-env`: an environment evaluated against an OpenAI-compatible endpoint (mock server)."""

from __future__ import annotations

import json

import httpx
import pytest

from asyncrl.envs import build_env
from asyncrl.launcher.cli import main as cli_main
from asyncrl.tools import endpoint_eval


def _serve(monkeypatch, models: list[str], seen: list[str] | None = None) -> None:
    """Route eval-env's HTTP client to a mock server listing `models`; it records each request's model
    in `seen`, answers only requests for a listed model, and reverses words of odd length only."""

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": m} for m in models]})
        body = json.loads(request.content)
        if seen is not None:
            seen.append(body["model"])
        if body["model"] not in models:
            return httpx.Response(404, json={"error": {"message": f"unknown model {body['model']!r}"}})
        word = body["messages"][-1]["content"].removeprefix("reverse: ")
        answer = word[::-1] if len(word) % 2 else word
        return httpx.Response(
            200, json={"choices": [{"message": {"content": answer}, "finish_reason": "stop"}]}
        )

    real_client = httpx.AsyncClient
    monkeypatch.setattr(
        endpoint_eval.httpx,
        "AsyncClient",
        lambda **kw: real_client(transport=httpx.MockTransport(handler), **kw),
    )


def test_eval_env_command_on_a_mock_server(capsys, monkeypatch):
    _serve(monkeypatch, ["tiny-moe"])
    assert cli_main(["eval-env", "--base-url", "http://srv", "--env", "reverse-text", "--num", "20"]) == 0
    out = capsys.readouterr().out
    env = build_env("reverse-text")
    words = [env.task("eval", i).answer for i in range(20)]
    expected_exact = sum(len(w) % 2 == 1 for w in words) / 20
    rows = dict(line.split() for line in out.splitlines()[1:])
    assert float(rows["rewards/exact"]) == pytest.approx(expected_exact, abs=1e-4)
    assert float(rows["num_episodes"]) == 20
    assert "metrics/num_turns" in out and "reverse-text (eval, 20 episodes)" in out


def test_without_model_the_requests_name_the_servers_only_model(capsys, monkeypatch):
    seen: list[str] = []
    _serve(monkeypatch, ["tiny-moe"], seen)
    assert cli_main(["eval-env", "--base-url", "http://srv", "--num", "3"]) == 0
    assert seen == ["tiny-moe"] * 3
    assert "on http://srv [tiny-moe]" in capsys.readouterr().out


def test_a_named_model_is_sent_as_named_and_a_refusal_is_one_line(capsys, monkeypatch):
    seen: list[str] = []
    _serve(monkeypatch, ["tiny-moe"], seen)
    assert cli_main(["eval-env", "--base-url", "http://srv", "--model", "tiny", "--num", "1"]) == 1
    err = capsys.readouterr().err
    assert seen == ["tiny"]
    assert err.startswith("asyncrl eval-env: POST /v1/chat/completions -> 404") and "Traceback" not in err


def test_a_server_with_several_models_needs_model(capsys, monkeypatch):
    _serve(monkeypatch, ["a", "b"])
    assert cli_main(["eval-env", "--base-url", "http://srv", "--num", "1"]) == 2
    err = capsys.readouterr().err
    assert "http://srv/v1/models lists 2 models ['a', 'b']; pick one with --model" in err


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
