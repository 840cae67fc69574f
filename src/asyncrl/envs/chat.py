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

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, token_ids: list[int]) -> str:
        """Text of sampled tokens, without special tokens (the eos that ended the turn)."""
        # No clean-up of spaces: the text must re-encode to the very same ids when re-rendered.
        return self.hf.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids
