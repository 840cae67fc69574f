"""The real `openai` client against the live server: completions, chat, streaming, auth."""

import openai
import pytest
from transformers import AutoTokenizer


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(server):
    return AutoTokenizer.from_pretrained(server.model_dir)


def test_models_lists_the_served_model(client, server):
    assert [m.id for m in client.models.list().data] == [server.name]


def test_completion_text_and_token_ids(client, server, tokenizer):
    resp = client.completions.create(
        model=server.name,
        prompt="Hello there",
        max_tokens=8,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    choice = resp.choices[0].model_dump()
    assert resp.usage.completion_tokens == 8 == len(choice["token_ids"])
    assert resp.model_dump()["prompt_token_ids"] == tokenizer.encode("Hello there")
    assert choice["text"] == tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
    assert choice["finish_reason"] == "length"


def test_completion_from_token_ids_with_logprobs_and_n(client, server):
    resp = client.completions.create(
        model=server.name,
        prompt=[257, 104, 105],
        max_tokens=5,
        n=3,
        seed=1,
        logprobs=1,
        extra_body={"ignore_eos": True},
    )
    assert len(resp.choices) == 3
    assert all(len(c.logprobs.token_logprobs) == 5 for c in resp.choices)
    assert all(lp <= 0 for c in resp.choices for lp in c.logprobs.token_logprobs)


def test_chat_completion_renders_template(client, server, tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    resp = client.chat.completions.create(
        model=server.name,
        messages=messages,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert resp.model_dump()["prompt_token_ids"] == tokenizer.encode(text, add_special_tokens=False)
    assert resp.choices[0].message.role == "assistant"
    assert len(resp.choices[0].logprobs.content) == resp.usage.completion_tokens == 6


def test_streaming_equals_non_streaming(client, server):
    kw = {"model": server.name, "max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}
    messages = [{"role": "user", "content": "count"}]
    full = client.chat.completions.create(messages=messages, **kw).choices[0].message.content
    chunks = list(client.chat.completions.create(messages=messages, stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full
    assert chunks[-1].choices[0].finish_reason == "length"
    full = client.completions.create(prompt="abc", **kw).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(prompt="abc", stream=True, **kw))
    assert streamed == full


def test_wrong_api_key_is_rejected(server):
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-17", prompt="x", max_tokens=2)
    assert e.value.body["param"] == "model"
