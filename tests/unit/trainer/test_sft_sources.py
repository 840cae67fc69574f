"""SFT tokenization: loss masks on assistant turns / completions, and clear errors for bad rows."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from asyncrl.model.tokenizer import save_byte_tokenizer
from asyncrl.trainer.sft_sources import (
    JsonlSFTSource,
    SFTDataError,
    tokenize_chat,
    tokenize_prompt_completion,
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    save_byte_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


def _trained_text(tokenizer, ids, mask) -> str:
    return tokenizer.decode([i for i, m in zip(ids, mask) if m])


def test_chat_loss_covers_assistant_turns_only(tokenizer):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "ciao"},
    ]
    ids, mask = tokenize_chat(tokenizer, messages, "row")
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    assert ids == tokenizer.encode(full, add_special_tokens=False)
    assert _trained_text(tokenizer, ids, mask) == "hello<|im_end|>\nciao<|im_end|>\n"


def test_prompt_completion_trains_completion_and_eos(tokenizer):
    ids, mask = tokenize_prompt_completion(tokenizer, "Reverse: abc\n", "cba", "row")
    assert ids == [*b"Reverse: abc\ncba", tokenizer.eos_token_id]
    assert mask == [False] * 13 + [True] * 4


def test_bad_rows_name_the_line_and_field(tokenizer, tmp_path):
    cases = {
        '{"prompt": "x"}': "expected field 'messages', or fields 'prompt' and 'completion'",
        '{"prompt": "x", "completion": 3}': "field 'completion' must be a string",
        '{"messages": [{"role": "user", "content": "x"}]}': "no assistant turn",
        "{nope": "not valid JSON",
        "[1, 2]": "a row must be a JSON object, got list",
    }
    for line, message in cases.items():
        path = tmp_path / "bad.jsonl"
        path.write_text(json.dumps({"prompt": "ok", "completion": "fine"}) + "\n" + line + "\n")
        with pytest.raises(SFTDataError, match=f"{path}:2: .*{message}"):
            JsonlSFTSource(path, tokenizer, batch_size=2, seq_len=64, seed=0, shuffle=True)


def test_batches_depend_only_on_the_step_and_cover_each_epoch(tokenizer, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"p{i}", "completion": f"c{i}"}) for i in range(5)))
    src = JsonlSFTSource(path, tokenizer, batch_size=2, seq_len=64, seed=1, shuffle=True)
    again = JsonlSFTSource(path, tokenizer, batch_size=2, seq_len=64, seed=1, shuffle=True)
    first_epoch = [tuple(s.token_ids) for step in (1, 2) for s in src.batch(step)] + [
        tuple(src.batch(3)[0].token_ids)
    ]
    assert len(set(first_epoch)) == 5
    assert [tuple(s.token_ids) for s in again.batch(7)] == [tuple(s.token_ids) for s in src.batch(7)]


def test_rows_with_tools_render_the_tool_block_like_rl_prompts():
    from asyncrl.model.tokenizer import build_byte_tokenizer
    from asyncrl.trainer.sft_sources import tokenize_chat

    tok = build_byte_tokenizer()
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {}}}]
    msgs = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    ids, mask = tokenize_chat(tok, msgs, "row 1", tools)
    prompt = tok.apply_chat_template(msgs[:1], tools=tools, tokenize=False, add_generation_prompt=True)
    assert tok.decode(ids).startswith(prompt) and '"name": "calc"' in prompt
    trained = tok.decode([i for i, m in zip(ids, mask) if m])
    assert trained == "4<|im_end|>\n"  # the template ends an assistant turn with a newline
