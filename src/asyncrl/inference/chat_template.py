"""Rendering chat requests to text: the model's own template, or (opt-in) a client's, sandboxed.

    text = render_chat(tokenizer, body, config)   # blocking: call it off the event loop

The model directory's template is trusted; clients only pass it variables (`chat_template_kwargs`),
never `apply_chat_template`'s own parameters, so they cannot swap the template through the back
door. A client template (`chat_template`) is rejected unless `allow_request_chat_template` is set;
then it runs in Jinja's immutable sandbox, under a wall-clock deadline (enforced by a trace hook,
so even a loop that emits nothing stops) and a bound on the rendered size.
"""

from __future__ import annotations

import inspect
import json
import operator
import sys
import time
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from asyncrl.config.inference import InferenceConfig
from asyncrl.inference.request import InvalidRequestError

__all__ = ["render_chat"]

# Errors a template can raise on odd-but-valid JSON input (a missing key, a list where a string was
# expected, raise_exception): all the client's doing, so all 400s.
_TEMPLATE_ERRORS = (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError)


def render_chat(tokenizer: Any, body: Any, config: InferenceConfig) -> str:
    """The prompt text of a ChatCompletionRequest; InvalidRequestError names the field at fault."""
    for i, m in enumerate(body.messages):
        if not isinstance(m.get("role"), str):
            raise InvalidRequestError(f"messages.{i}.role", "every message needs a string 'role'")
    variables = _template_variables(tokenizer, body.chat_template_kwargs or {})
    messages = _decoded_tool_arguments(body.messages)
    if body.chat_template is None:
        try:
            return tokenizer.apply_chat_template(
                messages,
                tools=body.tools,
                add_generation_prompt=body.add_generation_prompt,
                tokenize=False,
                **variables,
            )
        except _TEMPLATE_ERRORS as e:
            raise InvalidRequestError("messages", f"cannot render the chat template: {e}") from None
    if not config.allow_request_chat_template:
        raise InvalidRequestError(
            "chat_template", "client chat templates are disabled on this server", status=403
        )
    context = variables | {
        "messages": messages,
        "tools": body.tools,
        "add_generation_prompt": body.add_generation_prompt,
    }
    return render_sandboxed(
        body.chat_template,
        context,
        timeout_s=config.chat_template_timeout_s,
        max_chars=config.chat_template_max_chars,
    )


def _decoded_tool_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant `tool_calls` whose `function.arguments` is OpenAI's JSON string, with it parsed.

    Templates render `arguments` as an object (`| tojson`); given the string they would show the
    model its own call double-encoded, unlike what it wrote. Other messages are passed as they are.
    """
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if m.get("role") != "assistant" or not isinstance(calls, list):
            out.append(m)
            continue
        decoded = []
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            args = fn.get("arguments") if isinstance(fn, dict) else None
            if isinstance(args, str):
                try:
                    parsed = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError:
                    parsed = None
                if not isinstance(parsed, dict):
                    raise InvalidRequestError(
                        f"messages.{i}.tool_calls.{j}.function.arguments",
                        "tool call arguments must be a JSON object (as a string or an object)",
                    )
                call = call | {"function": fn | {"arguments": parsed}}
            decoded.append(call)
        out.append(m | {"tool_calls": decoded})
    return out


def _template_variables(tokenizer: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`chat_template_kwargs` as template variables only: apply_chat_template's own parameters
    (chat_template, tokenize, ...) are refused, as is any name that is not an identifier."""
    reserved = set(inspect.signature(tokenizer.apply_chat_template).parameters) | {"messages"}
    for key in kwargs:
        if key in reserved or not key.isidentifier():
            raise InvalidRequestError(
                f"chat_template_kwargs.{key}", "not a template variable this server accepts"
            )
    return kwargs


class _Limits(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox that also refuses `*` and `**` results beyond the size bound."""

    intercepted_binops = frozenset({"*", "**"})

    def __init__(self, max_chars: int) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
        self.max_chars = max_chars
        self.globals["raise_exception"] = _raise
        self.filters["tojson"] = lambda x, indent=None: json.dumps(x, indent=indent, ensure_ascii=False)

    def call_binop(self, context: Any, operator_: str, left: Any, right: Any) -> Any:
        if operator_ == "**":
            if isinstance(left, int | float) and isinstance(right, int | float) and abs(right) > 64:
                raise jinja2.sandbox.SecurityError("exponent too large")
            return operator.pow(left, right)
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, str | list | tuple) and isinstance(n, int) and len(seq) * n > self.max_chars:
                raise jinja2.sandbox.SecurityError("repetition exceeds the size bound")
        return operator.mul(left, right)


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


class _Deadline(Exception):
    pass


def render_sandboxed(source: str, context: dict[str, Any], *, timeout_s: float, max_chars: int) -> str:
    """Render an untrusted template; 400 (field `chat_template`) on error, overrun or oversize."""
    env = _Limits(max_chars)
    try:
        template = env.from_string(source)
    except jinja2.TemplateError as e:
        raise InvalidRequestError("chat_template", f"does not compile: {e}") from None
    deadline = time.monotonic() + timeout_s

    def trace(frame: Any, event: str, arg: Any) -> Any:  # runs on every call and line in this thread
        if time.monotonic() > deadline:
            raise _Deadline
        return trace

    chunks, size = [], 0
    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        for chunk in template.generate(**context):
            size += len(chunk)
            if size > max_chars:
                raise InvalidRequestError("chat_template", f"renders to more than {max_chars} characters")
            chunks.append(chunk)
    except _Deadline:
        raise InvalidRequestError("chat_template", f"did not finish rendering within {timeout_s} s") from None
    except _TEMPLATE_ERRORS as e:
        raise InvalidRequestError("chat_template", f"cannot render: {e}") from None
    finally:
        sys.settrace(previous)
    return "".join(chunks)
