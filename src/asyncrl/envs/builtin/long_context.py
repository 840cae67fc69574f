"""`long-context`: find one key's value in a long ledger read a page per turn; episodes grow to tens of
thousands of tokens.

The task: a ledger of `num_pages` pages, each about `page_chars` characters of `key = value` lines
(deterministic generated text, seeded per task), and a question: the value of one key, written on a
page before the last. Each turn adds one page to the conversation: the page the model asks for with
the `read_page` tool (a tool output, as an agent's file reads are), or, on a turn without a tool
call, the next unread page as a user message, so that even a model that never calls a tool (a random
one) is shown the whole ledger. A turn with `ANSWER: <value>` ends the episode, as does a turn
without a tool call once every page has been shown.

An episode is about `num_pages * page_chars` characters plus the model's turns: with the byte-level
tokenizer of the tiny presets one character is one token, so 8 pages of 3,500 characters make ~30k
tokens over 9 turns. Reward `exact`: the value after the last `ANSWER:` equals the key's value;
metric `pages_seen`: the share of pages shown.
"""

from __future__ import annotations

import json
import random
import re
import string

from asyncrl.envs.base import (
    EnvConfigError,
    Environment,
    EpisodeState,
    Message,
    Reward,
    Rubric,
    Split,
    Task,
    draw_in_split,
    task_rng,
)
from asyncrl.envs.tools import Tool, ToolError

__all__ = ["LongContextEnv", "render_page"]

_ANSWER_RE = re.compile(r"ANSWER:\s*(\S+)")
_SEEN = "pages_seen"
_MIN_PAGE_CHARS = 64


def _key(rng: random.Random) -> str:
    return "".join(rng.choices(string.ascii_lowercase, k=6)) + "-" + "".join(rng.choices(string.digits, k=4))


def _value(rng: random.Random) -> str:
    return "".join(rng.choices(string.ascii_uppercase + string.digits, k=8))


def _page_lines(doc_seed: int, page: int, page_chars: int) -> list[str]:
    rng = random.Random(doc_seed * 1_000_003 + page)
    lines, size = [], 0
    while True:
        line = f"{_key(rng)} = {_value(rng)}"
        if size + len(line) + 1 > page_chars:
            return lines
        lines.append(line)
        size += len(line) + 1


def render_page(task: Task, page: int) -> str:
    """Page `page` (1-based) of the task's ledger: a header line, then `key = value` lines."""
    info = task.info
    lines = _page_lines(info["doc_seed"], page, info["page_chars"])
    if page == info["answer_page"]:
        # Replacing a line keeps the page's length. A filler key equals the task's key with odds of
        # about 1e-12 per line (26^6 * 10^4 keys), which no reward can notice.
        lines[info["answer_line"] % len(lines)] = f"{info['key']} = {task.answer}"
    return f"page {page} of {info['num_pages']}\n" + "\n".join(lines)


def _answer_of(text: str) -> str | None:
    found = _ANSWER_RE.findall(text)
    return found[-1] if found else None


def _exact(state: EpisodeState) -> float:
    return float(_answer_of(state.final_text) == state.task.answer and "<tool_call>" not in state.final_text)


def _pages_seen(state: EpisodeState) -> float:
    return len(state.data.get(_SEEN, ())) / state.task.info["num_pages"]


class LongContextEnv(Environment):
    name = "long-context"
    rubric = Rubric(
        rewards=(Reward(name="exact", fn=_exact), Reward(name="pages_seen", fn=_pages_seen, weight=0.0))
    )

    def __init__(self, *, seed: int = 0, num_pages: int = 8, page_chars: int = 3500) -> None:
        if num_pages < 2:
            raise EnvConfigError(
                f"long-context: num_pages must be >= 2 (the answer is on an earlier page), got {num_pages}"
            )
        if page_chars < _MIN_PAGE_CHARS:
            raise EnvConfigError(f"long-context: page_chars must be >= {_MIN_PAGE_CHARS}, got {page_chars}")
        super().__init__(seed=seed)
        self.num_pages, self.page_chars = num_pages, page_chars
        # One turn per page, one to answer, and one spare for a re-read.
        self.max_turns = num_pages + 2

    def task(self, split: Split, index: int) -> Task:
        rng = task_rng(self.seed, self.name, split, index)
        key = draw_in_split(lambda: _key(rng), lambda k: f"{self.name}/{k}", split, env=self.name)
        info = {
            "key": key,
            "num_pages": self.num_pages,
            "page_chars": self.page_chars,
            "doc_seed": rng.getrandbits(48),
            "answer_page": rng.randint(1, self.num_pages - 1),
            "answer_line": rng.getrandbits(16),
        }
        question = (
            f"A ledger of {self.num_pages} pages holds lines `key = value`. Read it with the read_page "
            f"tool (pages 1 to {self.num_pages}); a turn without a tool call shows you the next unread "
            f"page. Once you know it, reply `ANSWER: <value>` with the value of the key `{key}`."
        )
        return Task(
            id=f"{self.name}/{split}/{index}",
            prompt=[{"role": "user", "content": question}],
            answer=_value(rng),
            info=info,
        )

    def tools(self, state: EpisodeState) -> list[Tool]:
        seen: set[int] = state.data.setdefault(_SEEN, set())
        num_pages = state.task.info["num_pages"]

        def read_page(page: int) -> str:
            """Read one page of the ledger, 1 to the number of pages."""
            if not 1 <= page <= num_pages:
                raise ToolError(f"page {page} does not exist; pages are 1 to {num_pages}")
            seen.add(page)
            return render_page(state.task, page)

        return [Tool.from_function(read_page)]

    async def respond(self, state: EpisodeState, text: str) -> list[Message] | None:
        seen: set[int] = state.data.setdefault(_SEEN, set())
        unread = [p for p in range(1, state.task.info["num_pages"] + 1) if p not in seen]
        if _answer_of(text) is not None or not unread:
            return None
        seen.add(unread[0])
        return [{"role": "user", "content": render_page(state.task, unread[0])}]

    def reference(self, task: Task) -> list[Message]:
        messages: list[Message] = []
        for page in range(1, task.info["answer_page"] + 1):
            call = json.dumps({"name": "read_page", "arguments": {"page": page}})
            messages.append({"role": "assistant", "content": f"<tool_call>{call}</tool_call>"})
            messages.append({"role": "tool", "name": "read_page", "content": render_page(task, page)})
        messages.append({"role": "assistant", "content": f"ANSWER: {task.answer}"})
        return messages
