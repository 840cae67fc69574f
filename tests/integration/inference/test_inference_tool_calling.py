"""OpenAI tool calling with the real `openai` client against the live server.

A random tiny model never writes a tool call, so the engine's `generate` is replaced by one that
"samples" the tokens of a fixed text; tokenization, decoding, parsing, the HTTP shapes and the
client's own parsing are all real.
"""

import json

import openai
import pytest
from transformers import AutoTokenizer

from asyncrl.inference.request import FinishReason, RequestOutput

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
REPLY = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture
def scripted(server, monkeypatch):
    """Make the engine sample `text`'s tokens (3 per step); returns a setter for the text."""
    tok = AutoTokenizer.from_pretrained(server.model_dir)
    script = {"text": REPLY}
    prompts = []

    async def generate(request_id, prompt, options, **kwargs):
        prompts.append(tok.decode(prompt))
        ids = tok.encode(script["text"], add_special_tokens=False)
        for i in range(0, len(ids), 3):
            last = i + 3 >= len(ids)
            yield RequestOutput(
                request_id=request_id,
                new_token_ids=ids[i : i + 3],
                new_logprobs=[-0.5] * len(ids[i : i + 3]),
                new_versions=[0] * len(ids[i : i + 3]),
                finish_reason=FinishReason.STOP if last else None,
            )

    monkeypatch.setattr(server.app.state.server.engine, "generate", generate)
    setter = lambda text: script.__setitem__("text", text)  # noqa: E731
    setter.prompts = prompts
    return setter


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0)


def _metric(server, name):
    with server.client() as c:
        line = next(x for x in c.get("/metrics").text.splitlines() if x.startswith(name + " "))
    return float(line.split()[1])


def test_openai_tool_calling_example_round_trip(client, server, scripted):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    resp = client.chat.completions.create(model=server.name, messages=messages, tools=TOOLS)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # The example's second step: the assistant turn and the tool result go back; the template renders them.
    scripted("It is sunny in Paris.")
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    final = client.chat.completions.create(model=server.name, messages=messages, tools=TOOLS)
    assert final.choices[0].message.content == "It is sunny in Paris."
    assert final.choices[0].message.tool_calls is None and final.choices[0].finish_reason == "stop"
    # the model sees its call as it wrote it (arguments an object, not OpenAI's JSON string) and the result
    assert '"name": "get_weather"' in scripted.prompts[0]  # the schema, in the system turn
    assert (
        'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|im_end|>\n'
        "<|im_start|>tool\nsunny, 21 C<|im_end|>\n<|im_start|>assistant\n"
    ) in scripted.prompts[1]


def test_tool_call_arguments_that_are_not_a_json_object_are_a_400(server):
    bad = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1, 2]"}}],
    }
    with server.client() as c:
        r = c.post(
            "/v1/chat/completions",
            json={
                "model": server.name,
                "tools": TOOLS,
                "messages": [{"role": "user", "content": "x"}, bad, {"role": "tool", "content": "y"}],
            },
        )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages.1.tool_calls.0.function.arguments"


def test_streaming_sends_content_then_tool_calls(client, server, scripted):
    chunks = list(
        client.chat.completions.create(
            model=server.name,
            messages=[{"role": "user", "content": "Paris?"}],
            tools=TOOLS,
            stream=True,
        )
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert content == "Checking." and "<tool_call>" not in content
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [
        (0, "get_weather", {"city": "Paris"})
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_malformed_call_stays_text_and_is_counted(client, server, scripted):
    before = _metric(server, "asyncrl_tool_calls_malformed_total")
    scripted("<tool_call>{bad json}</tool_call>")
    resp = client.chat.completions.create(
        model=server.name, messages=[{"role": "user", "content": "x"}], tools=TOOLS
    )
    assert resp.choices[0].message.content == "<tool_call>{bad json}</tool_call>"
    assert resp.choices[0].message.tool_calls is None and resp.choices[0].finish_reason == "stop"
    assert _metric(server, "asyncrl_tool_calls_malformed_total") == before + 1


def test_without_tools_the_text_is_returned_as_is(client, server, scripted):
    resp = client.chat.completions.create(model=server.name, messages=[{"role": "user", "content": "x"}])
    assert resp.choices[0].message.content == REPLY and resp.choices[0].message.tool_calls is None
