"""Tools: Python functions with JSON-schema signatures, the text format that calls them, and execution.

Tool format (what the model writes, and what the built-in ChatML template documents to it)::

    <tool_call>{"name": "calc", "arguments": {"expression": "3 * (4 + 5)"}}</tool_call>

Several calls may appear in one turn. Results go back as one `{"role": "tool"}` message per call.
Malformed calls, unknown tools, bad arguments, exceptions and timeouts all come back to the model as
tool messages starting with "error:", and are counted; they never end the episode by themselves.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Union, get_args, get_origin, get_type_hints

__all__ = ["TOOL_CALL_RE", "Tool", "ToolCall", "ToolError", "ToolResult", "call_tool", "parse_tool_calls"]

_JSON_TYPES: dict[type, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}
TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)  # the blocks parse_tool_calls reads


class ToolError(Exception):
    """Raised by a tool to send a clean "error: <message>" back to the model."""


def _json_type(annotation: Any, where: str) -> dict[str, Any]:
    origin = get_origin(annotation)
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}
    if origin is list:
        (item,) = get_args(annotation) or (str,)
        return {"type": "array", "items": _json_type(item, where)}
    if origin is dict:
        return {"type": "object"}
    if origin in (Union, types.UnionType):
        inner = [a for a in get_args(annotation) if a is not type(None)]
        if len(inner) == 1:
            return _json_type(inner[0], where)
    raise TypeError(
        f"{where}: annotation {annotation!r} has no JSON-schema type (use str/int/float/bool/list)"
    )


@dataclass(frozen=True, kw_only=True)
class Tool:
    """A callable the model may invoke. `fn` may be sync or async and returns text (or JSON-able data).

    Example::

        def calc(expression: str) -> str:
            \"\"\"Evaluate an arithmetic expression.\"\"\"
        tool = Tool.from_function(calc)
        tool.schema  # {"type": "function", "function": {"name": "calc", "parameters": {...}}}
    """

    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the keyword arguments
    fn: Callable[..., Any] = field(repr=False)

    @classmethod
    def from_function(
        cls, fn: Callable[..., Any], *, name: str | None = None, description: str | None = None
    ) -> Tool:
        """Schema from the signature (bound `functools.partial` arguments are left out)."""
        tool_name = (
            name or getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", "")
        )
        target = getattr(fn, "func", fn)
        hints = get_type_hints(target)
        props: dict[str, Any] = {}
        required = []
        for pname, param in inspect.signature(fn).parameters.items():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                continue
            props[pname] = _json_type(hints.get(pname, str), f"tool {tool_name!r} parameter {pname!r}")
            if param.default is inspect.Parameter.empty:
                required.append(pname)
        doc = description or (inspect.getdoc(target) or "").split("\n\n")[0].replace("\n", " ")
        schema = {"type": "object", "properties": props, "required": required}
        return cls(name=tool_name, description=doc, parameters=schema, fn=fn)

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI / HF chat-template tool entry."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def check_arguments(self, arguments: dict[str, Any]) -> str | None:
        """A message naming the first bad argument, or None when they fit the schema."""
        props, required = self.parameters["properties"], self.parameters.get("required", [])
        for name in arguments:
            if name not in props:
                return f"unknown argument {name!r} for tool {self.name!r} (expected {sorted(props)})"
        for name in required:
            if name not in arguments:
                return f"missing argument {name!r} for tool {self.name!r}"
        checks = {
            "string": str,
            "integer": int,
            "number": (int, float),
            "boolean": bool,
            "array": list,
            "object": dict,
        }
        for name, value in arguments.items():
            expected = props[name].get("type")
            is_bool_as_number = isinstance(value, bool) and expected in ("integer", "number")
            if expected in checks and (is_bool_as_number or not isinstance(value, checks[expected])):
                return (
                    f"argument {name!r} of tool {self.name!r} must be {expected}, got {type(value).__name__}"
                )
        return None


@dataclass(frozen=True, kw_only=True)
class ToolCall:
    """A parsed call; `error` is set when the text could not be parsed (name/arguments then empty)."""

    name: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


@dataclass(frozen=True, kw_only=True)
class ToolResult:
    name: str
    content: str
    is_error: bool


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every `<tool_call>{json}</tool_call>` in `text`, in order. Arguments may be a JSON string."""
    calls = []
    for raw in TOOL_CALL_RE.findall(text):
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            calls.append(ToolCall(error=f"malformed tool call (invalid JSON: {e.msg} at char {e.pos})"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ToolCall(error='malformed tool call: expected {"name": str, "arguments": {...}}'))
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                args = None
        if not isinstance(args, dict):
            calls.append(
                ToolCall(name=obj["name"], error="malformed tool call: 'arguments' must be an object")
            )
            continue
        calls.append(ToolCall(name=obj["name"], arguments=args))
    return calls


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


async def call_tool(
    tools: dict[str, Tool], call: ToolCall, *, timeout_s: float, max_chars: int
) -> ToolResult:
    """Run one call. Errors (parse, lookup, arguments, raise, timeout) become error results for the model.

    Sync tools run in a worker thread, which a timeout cannot stop; tools that run untrusted code
    must go through `asyncrl.envs.sandbox`, whose subprocess is killed on its own deadline.
    """
    if call.error is not None:
        return ToolResult(name=call.name, content=f"error: {call.error}", is_error=True)
    tool = tools.get(call.name)
    if tool is None:
        return ToolResult(
            name=call.name,
            content=f"error: unknown tool {call.name!r} (available: {sorted(tools)})",
            is_error=True,
        )
    problem = tool.check_arguments(call.arguments)
    if problem is not None:
        return ToolResult(name=call.name, content=f"error: {problem}", is_error=True)
    try:
        if inspect.iscoroutinefunction(tool.fn) or inspect.iscoroutinefunction(
            getattr(tool.fn, "func", None)
        ):
            value = await asyncio.wait_for(tool.fn(**call.arguments), timeout_s)
        else:
            value = await asyncio.wait_for(asyncio.to_thread(tool.fn, **call.arguments), timeout_s)
    except ToolError as e:
        return ToolResult(name=call.name, content=f"error: {e}", is_error=True)
    except TimeoutError:
        return ToolResult(
            name=call.name, content=f"error: tool {call.name!r} timed out after {timeout_s:g}s", is_error=True
        )
    except Exception as e:  # tool boundary: any failure is reported to the model, not raised
        return ToolResult(name=call.name, content=f"error: {type(e).__name__}: {e}", is_error=True)
    text = _as_text(value)
    if len(text) > max_chars:
        text = text[:max_chars] + f"\n[truncated {len(text) - max_chars} chars]"
    return ToolResult(name=call.name, content=text, is_error=False)
