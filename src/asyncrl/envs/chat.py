"""Chat rendering for token trajectories: a model directory's chat template, as exact token ids.

`ChatTokenizer` wraps a Hugging Face tokenizer (`AutoTokenizer.from_pretrained(model_dir)`). The
rollout loop renders the whole conversation each turn and keeps only the suffix after the ids it
already has (see `asyncrl.envs.trajectory`), so the template is the single source of truth for
how messages, tool schemas and tool results become tokens.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["ChatTokenizer"]


class ChatTokenizer:
    """Messages -> token ids with the model's chat template; token ids -> text.

    Example::

        tok = ChatTokenizer.from_pretrained("outputs/tiny")
        ids = tok.render([{"role": "user", "content": "hi"}], tools=None)
        text = tok.decode(completion_ids)   # special tokens (eos) dropped
    """

    def __init__(self, hf_tokenizer: Any) -> None:
        if not getattr(hf_tokenizer, "chat_template", None):
            raise ValueError(
                f"tokenizer {getattr(hf_tokenizer, 'name_or_path', '?')!r} has no chat_template; "
                "environments need one to render conversations"
            )
        self.hf = hf_tokenizer
        self.eos_token_id: int = hf_tokenizer.eos_token_id
        self._special_ids = set(hf_tokenizer.all_special_ids)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> ChatTokenizer:
        from transformers import AutoTokenizer  # heavy import, paid only by callers that render

        return cls(AutoTokenizer.from_pretrained(str(path)))

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        text = self.hf.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return self.encode(text)

    def render_bridged(
        self, prev_ids: list[int], messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> list[int] | None:
        """`prev_ids` (ending in the last assistant turn's sampled ids) + the template's tokens after it.

        For when the plain re-rendering does not start with `prev_ids` only because the sampled
        completion's text does not re-encode to the sampled ids. The template must still be
        append-only: the rendering up to the last assistant message must be a token prefix of the
        full rendering. The end-of-turn tokens (`<|im_end|>\n` in ChatML) are found by rendering the
        assistant turn with two sentinel contents; the ones the completion already sampled (its eos)
        are not repeated. Returns None when the template does not allow this (then: a new sample).
        """
        last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
        if last is None:
            return None
        before = self.render(messages[: last + 1], tools, add_generation_prompt=False)
        full = self.render(messages, tools)
        closing = self._closing_tokens(messages[:last], tools)
        if full[: len(before)] != before or not closing or before[-len(closing) :] != closing:
            return None
        longest = min(len(closing), len(prev_ids))
        overlap = next(k for k in range(longest, -1, -1) if prev_ids[len(prev_ids) - k :] == closing[:k])
        return [*prev_ids, *closing[overlap:], *full[len(before) :]]

    def _closing_tokens(self, history: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """Tokens the template puts after an assistant message's content (common tail of two renderings)."""
        a, b = (
            self.render(
                [*history, {"role": "assistant", "content": f"sentinel{c}"}],
                tools,
                add_generation_prompt=False,
            )
            for c in "AB"
        )
        n = 0
        while n < min(len(a), len(b)) and a[len(a) - 1 - n] == b[len(b) - 1 - n]:
            n += 1
        return a[len(a) - n :] if n else []

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, token_ids: list[int]) -> str:
        """Text of sampled tokens, without special tokens (the eos that ended the turn)."""
        # No clean-up of spaces: the text must re-encode to the very same ids when re-rendered.
        return self.hf.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids
