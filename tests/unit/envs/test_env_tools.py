"""Tool schemas from signatures, the text tool-call format, and tool errors that go back to the model."""

from __future__ import annotations

import asyncio
import functools

from asyncrl.envs import Tool, ToolError, call_tool, parse_tool_calls


def add(a: int, b: int = 2, note: str | None = None) -> int:
    """Add two integers.

    More text that is not part of the description.
    """
    return a + b


def test_schema_from_signature():
    tool = Tool.from_function(add)
    assert tool.schema == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer"},
                    "b": {"type": "integer"},
                    "note": {"type": "string"},
                },
                "required": ["a"],
            },
        },
    }


def test_schema_leaves_out_bound_partial_arguments():
    def write(root: str, path: str, content: str) -> str:
        """Write."""
        return root + path + content

    tool = Tool.from_function(functools.partial(write, "/x"), name="write")
    assert list(tool.parameters["properties"]) == ["path", "content"]


def test_parse_tool_calls():
    text = (
        'thinking <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call> and '
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 5, \\"b\\": 1}"}</tool_call>'
        "<tool_call>{not json}</tool_call><tool_call>[1]</tool_call>"
    )
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls[:2]] == [("add", {"a": 1}), ("add", {"a": 5, "b": 1})]
    assert "invalid JSON" in calls[2].error and "malformed" in calls[3].error
    assert parse_tool_calls("no calls here") == []


def _call(tools, text, timeout_s=1.0):
    (call,) = parse_tool_calls(text)
    return asyncio.run(call_tool({t.name: t for t in tools}, call, timeout_s=timeout_s, max_chars=50))


def test_call_tool_results_and_errors():
    tool = Tool.from_function(add)
    ok = _call([tool], '<tool_call>{"name": "add", "arguments": {"a": 40}}</tool_call>')
    assert (ok.content, ok.is_error) == ("42", False)
    cases = {
        '{"name": "sub", "arguments": {}}': "unknown tool 'sub'",
        '{"name": "add", "arguments": {}}': "missing argument 'a'",
        '{"name": "add", "arguments": {"a": 1, "c": 2}}': "unknown argument 'c'",
        '{"name": "add", "arguments": {"a": "1"}}': "argument 'a' of tool 'add' must be integer",
        '{"name": "add", "arguments": {"a": true}}': "must be integer",
    }
    for body, message in cases.items():
        result = _call([tool], f"<tool_call>{body}</tool_call>")
        assert result.is_error and result.content.startswith("error: ") and message in result.content, body


def test_tool_exceptions_timeouts_and_long_output():
    def boom(x: str) -> str:
        raise KeyError(x)

    def clean(x: str) -> str:
        raise ToolError(f"no such thing: {x}")

    async def slow(x: str) -> str:
        await asyncio.sleep(30)
        return x

    def chatty(x: str) -> str:
        return x * 100

    tools = [Tool.from_function(f) for f in (boom, clean, slow, chatty)]
    r = _call(tools, '<tool_call>{"name": "boom", "arguments": {"x": "k"}}</tool_call>')
    assert r.is_error and r.content == "error: KeyError: 'k'"
    r = _call(tools, '<tool_call>{"name": "clean", "arguments": {"x": "k"}}</tool_call>')
    assert r.is_error and r.content == "error: no such thing: k"
    r = _call(tools, '<tool_call>{"name": "slow", "arguments": {"x": "k"}}</tool_call>', timeout_s=0.05)
    assert r.is_error and r.content == "error: tool 'slow' timed out after 0.05s"
    r = _call(tools, '<tool_call>{"name": "chatty", "arguments": {"x": "ab"}}</tool_call>')
    assert not r.is_error and r.content.startswith("ab" * 25) and r.content.endswith("[truncated 150 chars]")
