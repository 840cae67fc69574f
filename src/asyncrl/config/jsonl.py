"""JSON Lines data a user hands in (task data, SFT data): one JSON object per line.

    rows = parse_jsonl(path.read_text())   # [(line number, dict), ...]; blank lines are skipped

A line that is not JSON, or JSON that is not an object, raises `JsonlError` with its line number,
so each reader can name the file its own way. Torch-free, for every layer.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["JsonlError", "parse_jsonl"]


class JsonlError(ValueError):
    """A line that is not a JSON object; `line` is its 1-based number, `reason` says what is wrong."""

    def __init__(self, line: int, reason: str) -> None:
        super().__init__(f"line {line}: {reason}")
        self.line, self.reason = line, reason


def parse_jsonl(text: str) -> list[tuple[int, dict[str, Any]]]:
    """The object on each non-blank line of `text`, with its 1-based line number, in order."""
    rows = []
    for num, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise JsonlError(num, f"not valid JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(row, dict):
            raise JsonlError(num, f"a row must be a JSON object, got {type(row).__name__}")
        rows.append((num, row))
    return rows
