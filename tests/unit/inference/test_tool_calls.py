"""Parsing `<tool_call>` blocks into OpenAI tool calls; malformed blocks stay text and are counted."""

import json

from asyncrl.inference.tool_calls import parse_tool_calls, streamable_length


def test_well_formed_calls_become_tool_calls_and_leave_the_content():
    text = (
        'I will add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>{"name": "echo", "arguments": "{\\"text\\": \\"hi\\"}"}</tool_call>'
    )
    parsed = parse_tool_calls(text)
    assert parsed.content == "I will add."
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["add", "echo"]
    assert [json.loads(c["function"]["arguments"]) for c in parsed.tool_calls] == [
        {"a": 1, "b": 2},
        {"text": "hi"},
    ]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in parsed.tool_calls)
    assert len({c["id"] for c in parsed.tool_calls}) == 2 and parsed.num_malformed == 0


def test_only_tool_calls_means_no_content():
    parsed = parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert parsed.content is None and len(parsed.tool_calls) == 1


def test_malformed_blocks_stay_in_the_text_and_are_counted():
    bad = [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>["f"]</tool_call>',
    ]
    for block in bad:
        parsed = parse_tool_calls("x " + block)
        assert parsed.tool_calls == [] and parsed.num_malformed == 1 and parsed.content == "x " + block
    mixed = parse_tool_calls(
        '<tool_call>{"name": "f", "arguments": {}}</tool_call> <tool_call>oops</tool_call>'
    )
    assert (
        len(mixed.tool_calls) == 1
        and mixed.num_malformed == 1
        and mixed.content == "<tool_call>oops</tool_call>"
    )


def test_unclosed_block_is_malformed_and_plain_text_is_untouched():
    cut = parse_tool_calls('ok <tool_call>{"name": "f", "argu')
    assert (
        cut.tool_calls == [] and cut.num_malformed == 1 and cut.content == 'ok <tool_call>{"name": "f", "argu'
    )
    plain = parse_tool_calls("  just text  ")
    assert plain.content == "  just text  " and plain.tool_calls == [] and plain.num_malformed == 0


def test_streamable_length_holds_back_possible_tool_calls():
    assert streamable_length("hello") == 5
    assert streamable_length("hello <tool_call>{") == 6
    assert streamable_length("hello <tool_c") == 6  # may still become <tool_call>
    assert streamable_length("a < b") == 5
