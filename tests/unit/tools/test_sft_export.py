"""`asyncrl sft-data`: reference answers as SFT JSONL that the trainer's data source reads, some corrupted."""

from __future__ import annotations

import json
import random

import pytest
from transformers import AutoTokenizer

from asyncrl.tools.init_model import init_model
from asyncrl.tools.sft_export import SFTDataArgsError, corrupt_text, main, write_sft_data
from asyncrl.trainer.sft_sources import JsonlSFTSource


def one_edit_apart(a: str, b: str) -> bool:
    """b is a with one neighbour swap, one character dropped, duplicated or replaced."""
    if len(b) == len(a) - 1:
        return any(a[:i] + a[i + 1 :] == b for i in range(len(a)))
    if len(b) == len(a) + 1:
        return any(b[:i] + b[i + 1 :] == a for i in range(len(b)))
    diff = [i for i in range(len(a)) if a[i] != b[i]] if len(a) == len(b) else None
    if diff is None:
        return False
    if len(diff) == 1:
        return True
    return len(diff) == 2 and diff[1] == diff[0] + 1 and a[diff[0]] == b[diff[1]] and a[diff[1]] == b[diff[0]]


def test_corrupt_text_always_makes_exactly_one_edit():
    rng = random.Random(0)
    for text in ["a", "ab", "aaa", "abcde", "zzzy"] * 50:
        bad = corrupt_text(text, rng)
        assert bad != text and one_edit_apart(text, bad), (text, bad)


def test_rows_parse_with_the_sft_source_and_a_fraction_is_corrupted(tmp_path):
    init_model("tiny-dense", tmp_path / "model")
    out = tmp_path / "data" / "sft.jsonl"
    stats = write_sft_data("reverse-text", 400, out, corrupt_prob=0.25, seed=1, env_args={"max_len": 5})
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert stats["rows"] == len(rows) == 400
    wrong = 0
    for row in rows:
        user, assistant = row["messages"]
        assert user["role"] == "user" and assistant["role"] == "assistant"
        reference = user["content"].removeprefix("reverse: ")[::-1]
        wrong += assistant["content"] != reference
        assert assistant["content"] == reference or one_edit_apart(reference, assistant["content"])
    assert wrong == stats["corrupted"] and 60 < wrong < 140
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "model"))
    source = JsonlSFTSource(out, tokenizer, batch_size=8, seq_len=128, seed=0, shuffle=False)
    assert len(source.samples) == 400
    first = source.samples[0]
    trained = tokenizer.decode(first.token_ids[first.loss_mask].tolist())
    assert trained.startswith(rows[0]["messages"][1]["content"])


def test_same_seed_same_file_and_bad_arguments_name_the_flag(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_sft_data("reverse-text", 20, a, corrupt_prob=0.5, seed=3)
    write_sft_data("reverse-text", 20, b, corrupt_prob=0.5, seed=3)
    assert a.read_text() == b.read_text()
    with pytest.raises(SFTDataArgsError, match="--corrupt-prob"):
        write_sft_data("reverse-text", 5, a, corrupt_prob=1.5)
    with pytest.raises(SystemExit, match="did you mean 'reverse-text'"):
        main(["--env", "revers-text", "--num", "3", "--out", str(a)])
    with pytest.raises(SystemExit, match="--env-args"):
        main(["--env", "reverse-text", "--num", "3", "--out", str(a), "--env-args", "[1]"])
