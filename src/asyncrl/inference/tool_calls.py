"""OpenAI `tool_calls` from a completion's text, in the model family's tool-call format.

    parsed = parse_tool_calls('Let me add.<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    parsed.content     # "Let me add."
    parsed.tool_calls  # [{"id": "call_...", "type": "function",
                       #   "function": {"name": "add", "arguments": '{"a": 1}'}}]
    parsed.num_malformed  # 0

Qwen3's format (also Hermes' and asyncrl's built-in ChatML template): one JSON object
`{"name": str, "arguments": object}` between `<tool_call>` and `</tool_call>`, several per turn.
A block that is not such an object (bad JSON, no name, arguments not an object, never closed
because the turn was cut) is left in the content as the model wrote it and counted in
`num_malformed`: the caller sees exactly what was sampled, and the server counts it.

The parser works on decoded text only; the token ids a turn sampled are returned unchanged.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TOOL_CALL_OPEN", "ParsedToolCalls", "parse_tool_calls", "streamable_length"]

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_BLOCK_RE = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


@dataclass(frozen=True, kw_only=True)
class ParsedToolCalls:
    """A turn's text split into content and OpenAI tool calls (see the module docstring)."""

    content: str | None  # None when the turn was only tool calls, as OpenAI returns it
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    num_malformed: int = 0


def parse_tool_calls(text: str) -> ParsedToolCalls:
    """Well-formed `<tool_call>` blocks become tool calls; everything else stays content."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    num_malformed, pos = 0, 0
    for match in _BLOCK_RE.finditer(text):
        call = _tool_call(match.group(1))
        kept.append(text[pos : match.start()])
        if call is None:
            num_malformed += 1
            kept.append(match.group(0))
        else:
            calls.append(call)
        pos = match.end()
    tail = text[pos:]
    if TOOL_CALL_OPEN in tail:  # opened but never closed (the turn hit max_tokens)
        num_malformed += 1
    kept.append(tail)
    content: str | None = "".join(kept)
    if calls:
        content = content.strip() or None
    return ParsedToolCalls(content=content, tool_calls=calls, num_malformed=num_malformed)


def _tool_call(body: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": obj["name"], "arguments": json.dumps(arguments)},
    }


def streamable_length(text: str) -> int:
    """How much of a growing text can be streamed as content while tool calls are parsed.

    Everything before the first `<tool_call>`, and before a trailing partial `<tool_call`
    that may still become one; the rest waits for the end of the turn.
    """
    start = text.find(TOOL_CALL_OPEN)
    if start >= 0:
        return start
    for k in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if text.endswith(TOOL_CALL_OPEN[:k]):
            return len(text) - k
    return len(text)
