"""SFT data: tokenized sequences with a loss mask, from JSONL or any other `SFTSource`.

JSONL rows take one of two forms::

    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    {"prompt": "Reverse: abc\n", "completion": "cba"}

Chat rows are rendered with the model directory's chat template (`tokenize=False`, then
`encode(add_special_tokens=False)`), and the loss covers the assistant turns only (content and
end-of-turn token, not the `<|im_start|>assistant` header). Prompt/completion rows are encoded
as prompt + completion + eos, with the loss on completion + eos.

A source returns the sequences of step n as a function of n alone, so a resumed run sees the
same data as an uninterrupted one. Other sources (an environment's reference answers) implement
the same `SFTSource` protocol.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from asyncrl.config.jsonl import JsonlError, parse_jsonl
from asyncrl.wire import RolloutSample

__all__ = [
    "JsonlSFTSource",
    "SFTDataError",
    "SFTSource",
    "sft_sample",
    "tokenize_chat",
    "tokenize_prompt_completion",
]


class SFTDataError(ValueError):
    """An SFT data row is malformed; the message names the file, line and field."""


class SFTSource(Protocol):
    def batch(self, step: int) -> list[RolloutSample]:
        """All sequences (over every rank) for optimizer step `step` (1-based)."""
        ...


def sft_sample(token_ids: list[int], loss_mask: list[bool]) -> RolloutSample:
    """A supervised sequence in the rollout-sample layout (advantages 0, temperature 1, version 0)."""
    n = len(token_ids)
    return RolloutSample(
        token_ids=np.asarray(token_ids, np.int32),
        loss_mask=np.asarray(loss_mask, bool),
        inference_logprobs=np.zeros(n, np.float32),
        advantages=np.zeros(n, np.float32),
        temperatures=np.ones(n, np.float32),
        policy_versions=np.zeros(n, np.int32),
        env="sft",
    )


def _render(
    tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool, tools: list[dict] | None = None
) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools or None, tokenize=False, add_generation_prompt=generation_prompt
    )


def tokenize_chat(
    tokenizer: Any, messages: list[dict[str, Any]], where: str, tools: list[dict] | None = None
) -> tuple[list[int], list[bool]]:
    """Token ids and loss mask for a conversation; the loss covers assistant turns.

    `tools` (JSON schemas) are rendered by the chat template as in RL prompts, so an SFT'd tool
    environment sees the same tool block it will see during rollouts.
    """
    if not isinstance(messages, list) or not messages:
        raise SFTDataError(f"{where}: field 'messages' must be a non-empty list")
    if not any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages):
        raise SFTDataError(f"{where}: field 'messages' has no assistant turn to train on")
    ids: list[int] = []
    mask: list[bool] = []
    done = ""

    def extend(text: str, train: bool) -> None:
        nonlocal done
        if not text.startswith(done):
            raise SFTDataError(f"{where}: the chat template does not render turns as prefixes of each other")
        piece = tokenizer.encode(text[len(done) :], add_special_tokens=False)
        ids.extend(piece)
        mask.extend([train] * len(piece))
        done = text

    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise SFTDataError(f"{where}: messages[{i}] needs a 'role'")
        if m["role"] == "assistant":
            extend(_render(tokenizer, messages[:i], True, tools), False)
            extend(_render(tokenizer, messages[: i + 1], False, tools), True)
    extend(_render(tokenizer, messages, False, tools), False)
    return ids, mask


def tokenize_prompt_completion(
    tokenizer: Any, prompt: Any, completion: Any, where: str
) -> tuple[list[int], list[bool]]:
    for name, value in (("prompt", prompt), ("completion", completion)):
        if not isinstance(value, str):
            raise SFTDataError(f"{where}: field '{name}' must be a string, got {type(value).__name__}")
    p = tokenizer.encode(prompt, add_special_tokens=False)
    c = tokenizer.encode(completion, add_special_tokens=False)
    if tokenizer.eos_token_id is not None:
        c.append(tokenizer.eos_token_id)
    return p + c, [False] * len(p) + [True] * len(c)


def _tokenize_row(tokenizer: Any, row: dict[str, Any], where: str) -> tuple[list[int], list[bool]]:
    if "messages" in row:
        tools = row.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise SFTDataError(f"{where}: field 'tools' must be a list of JSON schemas")
        return tokenize_chat(tokenizer, row["messages"], where, tools)
    if "prompt" in row and "completion" in row:
        return tokenize_prompt_completion(tokenizer, row["prompt"], row["completion"], where)
    raise SFTDataError(
        f"{where}: expected field 'messages', or fields 'prompt' and 'completion'; got {sorted(row)}"
    )


class JsonlSFTSource:
    """Every row tokenized up front; batches walk a fresh seeded permutation each epoch."""

    def __init__(
        self, path: Path, tokenizer: Any, *, batch_size: int, seq_len: int, seed: int, shuffle: bool
    ) -> None:
        if not path.is_file():
            raise SFTDataError(f"SFT data file not found: {path}")
        try:
            rows = parse_jsonl(path.read_text())
        except JsonlError as e:
            raise SFTDataError(f"{path}:{e.line}: {e.reason}") from None
        self.samples: list[RolloutSample] = []
        truncated = 0
        for lineno, row in rows:
            ids, mask = _tokenize_row(tokenizer, row, f"{path}:{lineno}")
            truncated += len(ids) > seq_len
            if any(mask[1:seq_len]):
                self.samples.append(sft_sample(ids[:seq_len], mask[:seq_len]))
        if not self.samples:
            raise SFTDataError(f"{path}: no row has a loss token within seq_len={seq_len}")
        if truncated:
            warnings.warn(
                f"{path}: {truncated} rows longer than seq_len={seq_len} were truncated", stacklevel=2
            )
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle

    def _order(self, epoch: int) -> np.ndarray:
        n = len(self.samples)
        return np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)

    def batch(self, step: int) -> list[RolloutSample]:
        n = len(self.samples)
        out = []
        for k in range((step - 1) * self.batch_size, step * self.batch_size):
            out.append(self.samples[int(self._order(k // n)[k % n])])
        return out
