"""`asyncrl eval-env --env verifiers:MODULE` against the live server (tests/vf_envs environments)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from asyncrl.inference.request import FinishReason, RequestOutput
from asyncrl.tools import endpoint_eval
from helpers import child_env

pytest.importorskip("verifiers.v1", reason="verifiers is an optional extra: pip install -e '.[verifiers]'")

TESTS = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("module", ["vf_envs.vf_reverse", "vf_envs.vf_adder"])
def test_eval_env_runs_a_verifiers_environment(server, module):
    env = child_env(PYTHONPATH=os.pathsep.join([child_env()["PYTHONPATH"], str(TESTS)]))
    argv = [
        sys.executable,
        "-m",
        "asyncrl",
        "eval-env",
        "--base-url",
        server.url,
        "--model",
        server.name,
        "--api-key",
        server.api_key,
        "--env",
        f"verifiers:{module}",
        "--env-args",
        '{"num_tasks": 8}',
        "--split",
        "train",
        "--num",
        "4",
        "--max-tokens",
        "8",
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split() for line in proc.stdout.splitlines()[1:])
    assert float(lines["num_episodes"]) == 4 and float(lines["metrics/failed"]) == 0.0
    # the env's own reward names reached the summary (a random model scores ~0 on them)
    names = {"vf_envs.vf_reverse": ["exact", "reply_chars"], "vf_envs.vf_adder": ["correct", "used_tool"]}[
        module
    ]
    assert all(f"rewards/{n}" in lines for n in names), proc.stdout
    assert float(lines["metrics/num_turns"]) >= 1.0


@pytest.fixture
def tool_using_model(server, monkeypatch):
    """The engine "samples" a right `calc_add` call, then the sum once the tool result is in the prompt.

    Everything else is real: the chat template, the OpenAI `tools` and `tool_calls` shapes, the
    verifiers toolset and the task's own rewards.
    """
    tok = AutoTokenizer.from_pretrained(server.model_dir)
    prompts: list[str] = []

    async def generate(request_id, prompt, options, **kwargs):
        text = tok.decode(prompt)
        prompts.append(text)
        a, b = map(int, re.search(r"What is (\d+) \+ (\d+)\?", text).groups())
        if result := re.search(r"<\|im_start\|>tool\n(\d+)<\|im_end\|>", text):
            reply = f"The answer is {result.group(1)}"  # the tool's output, as the model would copy it
        else:
            reply = f'<tool_call>{{"name": "calc_add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'
        ids = tok.encode(reply, add_special_tokens=False)
        yield RequestOutput(
            request_id=request_id,
            new_token_ids=ids,
            new_logprobs=[-0.5] * len(ids),
            new_versions=[0] * len(ids),
            finish_reason=FinishReason.STOP,
        )

    monkeypatch.setattr(server.app.state.server.engine, "generate", generate)
    return prompts


def test_eval_env_drives_a_verifiers_tool_through_openai_tool_calls(
    server, tool_using_model, capsys, monkeypatch
):
    monkeypatch.syspath_prepend(str(TESTS))
    argv = [
        "--base-url",
        server.url,
        "--model",
        server.name,
        "--api-key",
        server.api_key,
        "--env",
        "verifiers:vf_envs.vf_adder",
        "--env-args",
        '{"num_tasks": 8}',
        "--split",
        "train",
        "--num",
        "3",
        "--max-tokens",
        "64",
    ]
    assert endpoint_eval.main(argv) == 0
    lines = dict(line.split() for line in capsys.readouterr().out.splitlines()[1:])
    assert float(lines["reward"]) == 1.0 and float(lines["metrics/failed"]) == 0.0
    assert float(lines["rewards/correct"]) == 1.0 and float(lines["rewards/used_tool"]) == 1.0
    assert float(lines["metrics/num_tool_calls"]) == 1.0 and float(lines["metrics/num_turns"]) == 2.0
    assert len(tool_using_model) == 6  # two model calls per episode
    assert all('"name": "calc_add"' in p for p in tool_using_model)  # the schema went out as OpenAI `tools`
