"""A `verifiers` (0.4, `verifiers.v1`) environment as an asyncrl `Environment`.

    [[orchestrator.envs.envs]]
    name = "verifiers:my_env"          # an importable module exporting a vf.Taskset via __all__
    args = { num_tasks = 50 }          # the taskset's TasksetConfig fields

    env = build_env("verifiers:my_env", {"num_tasks": 50}, seed=0)

What comes from verifiers and what from asyncrl:
- tasks: the taskset's `load()`; a task's `system_prompt` and `prompt` (text or messages) open the
  episode. Tasks are split by their key (`Task.key`, 1 in 8 to eval, as the built-ins do) and
  shuffled under the seed; `task(split, i)` wraps around the split, and an empty split
  is an error (never the other split's tasks).
- tools: the `@vf.tool` methods of the task's and the taskset's `vf.Toolset`s, called in-process
  (no MCP server, no runtime), named as verifiers' chat harness names them (`<server>_<tool>`).
- the chat loop is asyncrl's (verifiers' plain chat harness, "null"): the model writes, tool calls
  run, a turn without tool calls ends the episode. Every model call goes through asyncrl's policy,
  so samples are stitched from the exact token ids with per-token versions and routing.
- scoring: the finished conversation becomes a `vf.Trace` and the task's own `score` fills its
  `@vf.reward`s (weighted; their weighted sum is the episode reward) and `@vf.metric`s (reported
  under `rewards` with their names). A reward or tool that raises fails the episode, not the run.
  In the trace every tool call, malformed ones included, has its own id and its own result, and
  the stop condition says how the episode ended (`agent_completed`, `max_turns`,
  `max_total_tokens`, `max_input_tokens`, `agent_timeout`), as verifiers' own rollout records them.

Not supported (an error says so when it matters): custom harnesses (bash, codex, ...) and
runtimes, `@vf.stop` / `@vf.intercept` hooks, judges that call a model, infinite tasksets,
multimodal prompts. A module offering `load_environment(**args)` that returns a `vf.Env` is loaded
through it, and its taskset is used as above.
"""

from __future__ import annotations

import importlib
import json
import random
from typing import Any

from asyncrl.envs.base import EnvConfigError, Environment, EpisodeState, Rubric, Split, Task, split_of
from asyncrl.envs.tools import TOOL_CALL_RE, Tool, ToolCall, parse_tool_calls

__all__ = ["VERIFIERS_PREFIX", "VerifiersEnv", "VerifiersRubric"]

VERIFIERS_PREFIX = "verifiers:"
# asyncrl's stop reasons named as verifiers names the same ends ("deadline" and "aborted": see _stop)
# ("context_limit": the prompt filled the server's context, verifiers' input-token limit)
_STOP_CONDITIONS = {
    "done": "agent_completed",
    "max_turns": "max_turns",
    "max_tokens": "max_total_tokens",
    "context_limit": "max_input_tokens",
}
_MISSING = "verifiers is not installed: pip install -e '.[verifiers]' (verifiers==0.4.0)"


def _vf() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise ImportError(_MISSING) from e
    return vf


class VerifiersRubric(Rubric):
    """Scores an episode with its verifiers task (`Task.score` over a `vf.Trace`)."""

    def __init__(self) -> None:
        super().__init__(rewards=())

    async def score(self, state: EpisodeState) -> tuple[float, dict[str, float]]:
        vf_task = state.task.info["vf_task"]
        if state.stop_reason is None:
            raise ValueError("a verifiers episode is scored once run_episode has stopped it (no stop_reason)")
        calls_ran = bool(_tools(state.data["vf_toolsets"]))
        trace = build_trace(vf_task, state.messages, stop_reason=state.stop_reason, calls_ran=calls_ran)
        await vf_task.score(trace)
        values = {name: float(r.score) for name, r in trace.rewards.items() if r is not None}
        values |= {name: float(v) for name, v in trace.metrics.items() if v is not None}
        unscored = [n for n, r in (trace.rewards | trace.metrics).items() if r is None]
        if unscored:
            raise ValueError(f"verifiers task left {unscored} unscored")
        return float(trace.reward), values


class VerifiersEnv(Environment):
    name = "verifiers"
    max_turns = 16

    def __init__(self, *, module: str, seed: int = 0, **args: Any) -> None:
        super().__init__(seed=seed)
        vf = _vf()
        self.module = module
        self.taskset = _load_taskset(vf, module, args)
        if not self.taskset.bounded:
            raise EnvConfigError(f"verifiers:{module}: infinite tasksets are not supported")
        tasks = list(self.taskset)
        if not tasks:
            raise EnvConfigError(f"verifiers:{module}: the taskset has no tasks")
        self._splits: dict[str, list[Any]] = {"train": [], "eval": []}
        for t in tasks:
            self._splits[split_of(f"{module}/{t.key}")].append(t)
        for split, items in self._splits.items():
            random.Random(f"{seed}/{module}/{split}").shuffle(items)
        self.rubric = VerifiersRubric()

    def task(self, split: Split, index: int) -> Task:
        items = self._splits[split]
        if not items:  # never borrow the other split: train and eval must not share a task
            total = sum(len(v) for v in self._splits.values())
            raise ValueError(
                f"verifiers:{self.module}: no {split} tasks; its {total} tasks are split by Task.key, "
                "1 in 8 to eval, and none fell in this split (give the taskset more tasks)"
            )
        vf_task = items[index % len(items)]
        return Task(
            id=f"verifiers:{self.module}/{split}/{index}",
            prompt=_prompt(vf_task.data),
            info={"vf_task": vf_task, "key": vf_task.key},
        )

    def reference(self, task: Task) -> list[dict[str, Any]]:
        raise NotImplementedError("verifiers environments carry no reference solutions")

    async def setup(self, task: Task) -> EpisodeState:
        vf_task = task.info["vf_task"]
        servers = [*type(vf_task).toolsets(vf_task.config), *type(self.taskset).toolsets(self.taskset.config)]
        for server in servers:
            await server.setup()
            await server.setup_task(vf_task)
        return EpisodeState(task=task, messages=list(task.prompt), data={"vf_toolsets": servers})

    def tools(self, state: EpisodeState) -> list[Tool]:
        return _tools(state.data["vf_toolsets"])


def _tools(servers: list[Any]) -> list[Tool]:
    from verifiers.v1.utils.decorators import discover_decorated

    tools = []
    for server in servers:
        for fn in discover_decorated(server, "tool"):
            name = getattr(fn, "tool_name", None) or fn.__name__
            full = f"{server.server_name}_{name}" if server.server_name else name
            tools.append(Tool.from_function(fn, name=full, description=(fn.__doc__ or "").strip()))
    return tools


def _load_taskset(vf: Any, module: str, args: dict[str, Any]) -> Any:
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise EnvConfigError(f"verifiers:{module}: cannot import {module!r} ({e})") from e
    load_environment = getattr(mod, "load_environment", None)
    if callable(load_environment):
        env = load_environment(**args)
        if not isinstance(env, vf.Env):
            raise EnvConfigError(
                f"verifiers:{module}: load_environment returned {type(env).__name__}, not a vf.Env"
            )
        return env.taskset
    exported = [getattr(mod, n, None) for n in getattr(mod, "__all__", ())]
    found = [c for c in exported if isinstance(c, type) and issubclass(c, vf.Taskset) and c is not vf.Taskset]
    if len(found) != 1:
        raise EnvConfigError(
            f"verifiers:{module}: the module must export exactly one vf.Taskset subclass in __all__ "
            f"(or offer load_environment); found {[c.__name__ for c in found]}"
        )
    cls = found[0]
    config_cls = _config_class(cls, vf)
    try:
        config = config_cls.model_validate({"id": module, **args})
    except Exception as e:  # pydantic's ValidationError names the field
        raise EnvConfigError(f"verifiers:{module}: bad args {sorted(args)}: {e}") from None
    return cls(config)


def _config_class(cls: type, vf: Any) -> type:
    from verifiers.v1.utils.generic import concrete_type

    return concrete_type(cls, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig


def _prompt(data: Any) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if data.system_prompt:
        messages.append({"role": "system", "content": data.system_prompt})
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    else:
        for m in data.prompt or []:
            wire = m.model_dump(exclude_none=True)
            if not isinstance(wire.get("content", ""), str):
                raise ValueError(f"task {data.idx}: only text content is supported (multimodal prompt)")
            messages.append(wire)
    return messages


def build_trace(vf_task: Any, messages: list[dict[str, Any]], *, stop_reason: str, calls_ran: bool) -> Any:
    """The conversation as a linear `vf.Trace` (sampled = the model's turns), ready for `Task.score`.

    Every `<tool_call>` of a turn becomes a `vf.ToolCall` with an id of its own, malformed ones
    included, and the tool messages after the turn answer them in order: one result per call, as
    verifiers' chat harness pairs them. Without tools (`calls_ran` False) the loop ran no call and a
    turn is all text. The trace is stopped the way verifiers' rollout stops it (`_stop`).
    """
    vf = _vf()
    nodes, pending_ids = [], []
    for i, m in enumerate(messages):
        role, content = m["role"], m.get("content") or ""
        if role == "assistant":
            message = _assistant_message(vf, content, id_prefix=f"call_{i}", calls_ran=calls_ran)
            pending_ids = [c.id for c in message.tool_calls or []]
        elif role == "tool":
            if not pending_ids:
                raise ValueError(f"message {i} is a tool result that answers no call of the turn before it")
            call_id, name = pending_ids.pop(0), m.get("name") or None  # an unreadable call has no name
            message = vf.ToolMessage(tool_call_id=call_id, content=content, name=name)
        elif role == "system":
            message = vf.SystemMessage(content=content)
        else:
            message = vf.UserMessage(content=content)
        parent = len(nodes) - 1 if nodes else None
        nodes.append(vf.MessageNode(parent=parent, message=message, sampled=role == "assistant"))
    task = vf.TraceTask(type=type(vf_task).__name__, data=vf_task.data, key=vf_task.key, hash=vf_task.hash)
    trace = vf.Trace(task=task, agent=vf.AgentInfo(config=vf.AgentConfig()), nodes=nodes, ok=True)
    _stop(vf, trace, stop_reason)
    return trace


def _assistant_message(vf: Any, text: str, *, id_prefix: str, calls_ran: bool) -> Any:
    """The turn's prose as content and its calls as tool calls (ids `<id_prefix>_<k>`), or all text."""
    bodies = TOOL_CALL_RE.findall(text) if calls_ran else []
    if not bodies:
        return vf.AssistantMessage(content=text)
    parsed = parse_tool_calls(text)
    assert len(parsed) == len(bodies), "parse_tool_calls reads the same <tool_call> blocks"
    calls = [
        vf.ToolCall(id=f"{id_prefix}_{k}", name=call.name, arguments=_arguments_as_written(call, body))
        for k, (call, body) in enumerate(zip(parsed, bodies))
    ]
    return vf.AssistantMessage(content=TOOL_CALL_RE.sub("", text).strip() or None, tool_calls=calls)


def _arguments_as_written(call: ToolCall, body: str) -> str:
    """`vf.ToolCall.arguments`: JSON text (a string as written); the whole call if it has no readable name."""
    if call.error is not None and not call.name:
        return body
    arguments = json.loads(body).get("arguments", {})
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _stop(vf: Any, trace: Any, stop_reason: str) -> None:
    """Stop the trace as verifiers' rollout stops one before scoring it: every scored trace is stopped
    (`is_completed`), and `stop_condition`, `is_truncated` and `is_timeout` tell a finished episode
    from one cut by a limit or a deadline."""
    if stop_reason == "deadline":
        trace.record_timeout("agent")  # a stop, not a failure: the partial episode is scored
    elif stop_reason == "aborted":  # the server dropped the model call: a failed call to verifiers
        trace.record_error(vf.ProviderError("the inference server aborted the request"))
    elif stop_reason in _STOP_CONDITIONS:
        trace.stop(_STOP_CONDITIONS[stop_reason])
    else:
        raise ValueError(f"no verifiers stop condition for an episode that stopped with {stop_reason!r}")
