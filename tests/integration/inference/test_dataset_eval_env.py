"""`asyncrl eval-env --env dataset` on task files written here, against the live server."""

import json

import pytest
from transformers import AutoTokenizer

from asyncrl.inference.request import FinishReason, RequestOutput
from asyncrl.tools import endpoint_eval


@pytest.fixture
def answering_model(server, monkeypatch):
    """The engine "samples" the right answer for questions `What is A + B?` (and 0 for the others)."""
    tok = AutoTokenizer.from_pretrained(server.model_dir)
    seen: list[str] = []

    async def generate(request_id, prompt, options, **kwargs):
        text = tok.decode(prompt)
        seen.append(text)
        question = text.rsplit("<|im_start|>user\n", 1)[1]
        a, b = (int(x) for x in question.split("What is ")[1].split("?")[0].split(" + "))
        ids = tok.encode(f"It is {a + b if a % 2 == 0 else 0}.", add_special_tokens=False)
        yield RequestOutput(
            request_id=request_id,
            new_token_ids=ids,
            new_logprobs=[-0.5] * len(ids),
            new_versions=[0] * len(ids),
            finish_reason=FinishReason.STOP,
        )

    monkeypatch.setattr(server.app.state.server.engine, "generate", generate)
    return seen


def test_eval_env_scores_tasks_read_from_a_jsonl_file(server, answering_model, tmp_path, capsys):
    rows = [{"q": f"What is {i} + 3?", "sol": i + 3} for i in range(16)]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "train.jsonl").write_text(json.dumps({"q": "What is 1 + 1?", "sol": 2}) + "\n")
    data = {
        "path": str(tmp_path / "train.jsonl"),
        "eval_path": str(tmp_path / "eval.jsonl"),
        "prompt_field": "q",
        "answer_field": "sol",
        "system_prompt": "Answer with a number.",
    }
    argv = [
        "--base-url",
        server.url,
        "--model",
        server.name,
        "--api-key",
        server.api_key,
        "--env",
        "dataset",
        "--env-args",
        json.dumps({"data": data, "reward": "number"}),
        "--num",
        "16",
    ]
    assert endpoint_eval.main(argv) == 0
    lines = dict(line.split() for line in capsys.readouterr().out.splitlines()[1:])
    # every eval row once (16 of 16, no train row); the even ones answered right
    assert sorted(q.rsplit("user\n", 1)[1].split("<|im_end|>")[0] for q in answering_model) == sorted(
        r["q"] for r in rows
    )
    assert all("<|im_start|>system\nAnswer with a number.<|im_end|>" in q for q in answering_model)
    assert float(lines["reward"]) == 0.5 and float(lines["rewards/number"]) == 0.5
    assert float(lines["metrics/failed"]) == 0.0 and float(lines["num_episodes"]) == 16
