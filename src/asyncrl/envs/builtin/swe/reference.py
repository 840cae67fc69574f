"""The reference solution of a `swe` task as tool calls: the task's patch, applied through the agent's tools.

    messages = reference_messages(task, source, commit, max_chars=3000)
    # assistant: <tool_call>{"name": "str_replace",
    #             "arguments": {"path": ..., "old_str": ..., "new_str": ...}}</tool_call>
    # tool:      Edited mylib/ops.py. Lines 3-9 now read: ...
    # ...        then "submit"

Each hunk of a modified file becomes one `str_replace` when its old text occurs exactly once at
that point (and the replacements together give the patched file); otherwise the whole file is
written with `create`. New files are `create`d, deleted ones removed with `bash rm`, renames are
both. The tool replies are computed with the tools' own text functions, so replaying the
assistant turns reproduces the transcript exactly (short replies: under `max_tool_output_chars`).
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from asyncrl.envs.builtin.swe.checkout import GitSource
from asyncrl.envs.builtin.swe.patch import FilePatch, PatchError, apply_hunks, parse_patch
from asyncrl.envs.builtin.swe.tasks import SweTask
from asyncrl.envs.builtin.swe.tools import SUBMITTED, created_message, cut_middle, replace_text
from asyncrl.envs.tools import ToolError

__all__ = ["reference_messages"]

Message = dict[str, Any]


def _exchange(name: str, arguments: dict[str, Any], reply: str) -> list[Message]:
    call = json.dumps({"name": name, "arguments": arguments})
    return [
        {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
        {"role": "tool", "name": name, "content": reply},
    ]


def _replacements(text: str, patch: FilePatch, final: str, max_chars: int) -> list[Message] | None:
    """One str_replace per hunk, or None when a hunk's old text is not unique where it applies."""
    messages = []
    for hunk in patch.hunks:
        if not hunk.old_text or text.count(hunk.old_text) != 1:
            return None
        try:
            text, reply = replace_text(text, patch.path, hunk.old_text, hunk.new_text)
        except ToolError:
            return None
        args = {"path": patch.path, "old_str": hunk.old_text, "new_str": hunk.new_text}
        messages += _exchange("str_replace", args, cut_middle(reply, max_chars))
    return messages if text == final else None


def _file_messages(patch: FilePatch, source: GitSource, commit: str, max_chars: int) -> list[Message]:
    if patch.new_path is None:
        return _exchange("bash", {"command": f"rm {shlex.quote(patch.path)}"}, "exit code 0")
    old = source.show(commit, patch.old_path) if patch.old_path else ""
    if old is None:
        raise PatchError(f"{patch.old_path}: the patch changes a file the base commit does not have")
    final = apply_hunks(old, patch.hunks, path=patch.path)
    steps = None
    if patch.old_path == patch.new_path:
        steps = _replacements(old, patch, final, max_chars)
    if steps is None:
        existed = patch.old_path == patch.new_path
        steps = _exchange(
            "create",
            {"path": patch.new_path, "content": final},
            created_message(patch.new_path, final, existed),
        )
    if patch.old_path and patch.old_path != patch.new_path:
        steps += _exchange("bash", {"command": f"rm {shlex.quote(patch.old_path)}"}, "exit code 0")
    return steps


def reference_messages(task: SweTask, source: GitSource, commit: str, *, max_chars: int) -> list[Message]:
    """Assistant tool calls and tool replies that apply `task.patch` at `commit`, then submit."""
    if not task.patch.strip():
        raise PatchError(f"{task.where}: the task has no reference patch")
    messages: list[Message] = []
    for patch in parse_patch(task.patch):
        messages += _file_messages(patch, source, commit, max_chars)
    return messages + _exchange("submit", {}, SUBMITTED)
