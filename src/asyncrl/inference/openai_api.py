"""OpenAI-compatible `/v1/completions` and `/v1/chat/completions`, streaming included.

Text goes through the model directory's tokenizer (chat through its chat template); the engine
only sees token ids. Stop strings are cut from the returned text but the token that completed
them stays in `token_ids` (the exact tokens the policy sampled). With `return_token_ids`, each
choice also carries `token_ids` and `policy_versions`, and the response `prompt_token_ids`.

A chat request with `tools` gets the reply's `<tool_call>` blocks back as OpenAI `tool_calls`
(`tool_calls.py`; `finish_reason` "tool_calls"); malformed blocks stay in the content and are
counted in `/metrics`. Streaming holds text back from the first `<tool_call>` on and sends the
calls in the last chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from asyncrl.inference.chat_template import render_chat
from asyncrl.inference.protocol import ChatCompletionRequest, CompletionRequest, to_options
from asyncrl.inference.request import InvalidRequestError, RequestOutput, SamplingOptions
from asyncrl.inference.serving import Collected, ServerState, collect
from asyncrl.inference.tool_calls import ParsedToolCalls, parse_tool_calls, streamable_length
from asyncrl.wire import RoutedExperts

__all__ = ["add_openai_routes"]


def add_openai_routes(app: FastAPI) -> None:
    state: ServerState = app.state.server

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        _check_model(state, body.model)
        if body.echo:
            raise InvalidRequestError("echo", "echo is not supported")
        if isinstance(body.prompt, list):
            prompt = body.prompt
        else:
            prompt = await _tokenize(state, body.prompt, "prompt", add_special_tokens=True)
        max_tokens = body.max_tokens or 16
        return await _respond(state, http, body, prompt, max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: Request):
        _check_model(state, body.model)
        text = await asyncio.to_thread(render_chat, state.tokenizer, body, state.config)
        prompt = await _tokenize(state, text, "messages", add_special_tokens=False)
        limit = state.engine.engine.max_model_len - len(prompt)
        max_tokens = body.max_completion_tokens or body.max_tokens or max(limit, 1)
        return await _respond(state, http, body, prompt, max_tokens, chat=True)


def _check_model(state: ServerState, model: str) -> None:
    if model != state.model_name:
        raise InvalidRequestError(
            "model", f"unknown model {model!r}; this server serves {state.model_name!r}", status=404
        )


async def _tokenize(state: ServerState, text: str, field: str, *, add_special_tokens: bool) -> list[int]:
    """Token ids of `text`, computed off the event loop; text that cannot fit is refused untokenized.

    No token is longer than the vocabulary's longest entry, so `len(text) / max_token_chars` is a
    lower bound on the token count: over the context limit, tokenizing is not worth doing.
    """
    limit = state.engine.engine.max_model_len
    if len(text) > limit * state.max_token_chars:
        raise InvalidRequestError(
            field, f"{len(text)} characters cannot fit the context limit of {limit} tokens"
        )
    return await asyncio.to_thread(state.tokenizer.encode, text, add_special_tokens=add_special_tokens)


async def _respond(
    state: ServerState, http: Request, body: Any, prompt: list[int], max_tokens: int, chat: bool
):
    options = [to_options(body, max_tokens, seed_offset=i) for i in range(body.n)]
    kwargs = {"cache_salt": body.cache_salt, "return_routed_experts": body.return_routed_experts}
    if body.stream:
        if body.n != 1:
            raise InvalidRequestError("n", "streaming supports n = 1 only")
        return await _stream(state, body, prompt, options[0], kwargs, chat)
    results = await asyncio.gather(*(collect(state, http, prompt, o, **kwargs) for o in options))
    choices = [_choice(state, body, i, r, options[i], chat) for i, r in enumerate(results)]
    response = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": state.model_name,
        "choices": choices,
        "usage": _usage(prompt, results),
    }
    if body.return_token_ids:
        response["prompt_token_ids"] = prompt
    return response


def _usage(prompt: list[int], results: list[Collected]) -> dict[str, Any]:
    completion = sum(len(r.token_ids) for r in results)
    return {
        "prompt_tokens": len(prompt),
        "completion_tokens": completion,
        "total_tokens": len(prompt) + completion,
        "prompt_tokens_details": {"cached_tokens": max((r.num_cached_tokens for r in results), default=0)},
    }


def _text(state: ServerState, token_ids: list[int], stop: tuple[str, ...], finished: bool) -> str:
    """Decoded text, cut before the first stop string once the request has finished."""
    text = state.tokenizer.decode(token_ids, skip_special_tokens=True)
    if finished and stop:
        cuts = [i for s in stop if (i := text.find(s)) >= 0]
        if cuts:
            text = text[: min(cuts)]
    return text


def _choice(
    state: ServerState, body: Any, index: int, r: Collected, options: SamplingOptions, chat: bool
) -> dict:
    text = _text(state, r.token_ids, options.stop, finished=True)
    choice: dict[str, Any] = {"index": index, "finish_reason": r.finish_reason}
    tokens = state.tokenizer.convert_ids_to_tokens(r.token_ids)
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
        if _parses_tools(body):
            parsed = _parse(state, text)
            choice["message"] = {"role": "assistant", "content": parsed.content}
            if parsed.tool_calls:
                choice["message"]["tool_calls"] = parsed.tool_calls
                choice["finish_reason"] = _tool_finish(r.finish_reason)
        choice["logprobs"] = _chat_logprobs(tokens, r.logprobs) if body.logprobs else None
    else:
        choice["text"] = text
        choice["logprobs"] = None
        if body.logprobs is not None:
            choice["logprobs"] = {
                "tokens": tokens,
                "token_logprobs": r.logprobs,
                "top_logprobs": None,
                "text_offset": [],
            }
    if body.return_token_ids:
        choice["token_ids"], choice["policy_versions"] = r.token_ids, r.versions
    if r.routed_experts is not None:
        choice["routed_experts"] = RoutedExperts.from_array(r.routed_experts).model_dump()
    return choice


def _parses_tools(body: Any) -> bool:
    return bool(getattr(body, "tools", None)) and body.tool_choice != "none"


def _parse(state: ServerState, text: str) -> ParsedToolCalls:
    parsed = parse_tool_calls(text)
    state.counters["tool_calls_parsed"] += len(parsed.tool_calls)
    state.counters["tool_calls_malformed"] += parsed.num_malformed
    return parsed


def _tool_finish(reason: str) -> str:
    """OpenAI's finish reason for a turn that ends in tool calls ("length" stays: it was cut)."""
    return "tool_calls" if reason == "stop" else reason


def _chat_logprobs(tokens: list[str], logprobs: list[float]) -> dict[str, Any]:
    content = [
        {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8", "replace")), "top_logprobs": []}
        for t, lp in zip(tokens, logprobs)
    ]
    return {"content": content}


async def _stream(
    state: ServerState, body: Any, prompt: list[int], options: SamplingOptions, kwargs: dict, chat: bool
) -> StreamingResponse:
    """Server-sent events. The first output is awaited before answering, so bad input still gets a 4xx."""
    gen = state.engine.generate(uuid.uuid4().hex, prompt, options, **kwargs)
    try:
        first = await anext(gen)
    except BaseException:
        await gen.aclose()
        raise
    return StreamingResponse(
        _events(state, body, prompt, options, gen, first, chat), media_type="text/event-stream"
    )


async def _events(
    state: ServerState,
    body: Any,
    prompt: list[int],
    options: SamplingOptions,
    gen: AsyncIterator[RequestOutput],
    first: RequestOutput,
    chat: bool,
) -> AsyncIterator[str]:
    rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
    base = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": state.model_name,
    }
    hold = max((len(s) for s in options.stop), default=1) - 1  # a stop string may still be forming
    tools = chat and _parses_tools(body)
    result, sent = Collected(), ""
    async with contextlib.aclosing(gen):
        out: RequestOutput | None = first
        while out is not None:
            result.add(out)
            text = _text(state, result.token_ids, options.stop, finished=out.finished)
            safe = len(text) if out.finished else max(len(text) - hold, len(sent))
            if not out.finished and text[:safe].endswith("\ufffd"):
                safe = len(sent)  # an incomplete UTF-8 character; wait for its next bytes
            if tools and not out.finished:
                safe = max(len(sent), min(safe, streamable_length(text)))
            delta, sent = text[len(sent) : safe], text[:safe]
            reason = out.finish_reason.value if out.finished else None
            choice: dict[str, Any] = {"index": 0, "finish_reason": reason}
            if chat:
                choice["delta"] = (
                    {"role": "assistant", "content": delta} if out is first else {"content": delta}
                )
                if tools and out.finished:
                    parsed = _parse(state, delta)
                    choice["delta"]["content"] = parsed.content or ""
                    if parsed.tool_calls:
                        choice["delta"]["tool_calls"] = [
                            c | {"index": i} for i, c in enumerate(parsed.tool_calls)
                        ]
                        choice["finish_reason"] = _tool_finish(reason)
                choice["logprobs"] = None
            else:
                choice["text"], choice["logprobs"] = delta, None
            if body.return_token_ids:
                choice["token_ids"], choice["policy_versions"] = out.new_token_ids, out.new_versions
            yield f"data: {json.dumps(base | {'choices': [choice]})}\n\n"
            out = None if out.finished else await anext(gen, None)
    if body.stream_options and body.stream_options.get("include_usage"):
        yield f"data: {json.dumps(base | {'choices': [], 'usage': _usage(prompt, [result])})}\n\n"
    yield "data: [DONE]\n\n"
