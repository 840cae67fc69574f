"""The JSONL reader that task data and SFT data share."""

from __future__ import annotations

import pytest

from asyncrl.config.jsonl import JsonlError, parse_jsonl


def test_rows_keep_their_line_numbers_and_blank_lines_are_skipped():
    text = '{"a": 1}\n\n   \n{"b": [2, 3]}\n{"c": null}'
    assert parse_jsonl(text) == [(1, {"a": 1}), (4, {"b": [2, 3]}), (5, {"c": None})]
    assert parse_jsonl("") == []


@pytest.mark.parametrize(
    ("text", "line", "reason"),
    [
        ('{"a": 1}\n{"a": 2\n', 2, r"not valid JSON: Expecting ',' delimiter \(column 8\)"),
        ('{"a": 1}\n\n[1, 2]\n', 3, "a row must be a JSON object, got list"),
        ('"text"\n', 1, "a row must be a JSON object, got str"),
    ],
)
def test_a_bad_line_is_named_by_number(text, line, reason):
    with pytest.raises(JsonlError, match=rf"^line {line}: {reason}$") as err:
        parse_jsonl(text)
    assert err.value.line == line
