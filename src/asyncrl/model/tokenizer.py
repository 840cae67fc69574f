"""A byte-level tokenizer for models trained from scratch, built with `tokenizers`.

Token ids 0-255 are the raw bytes (so any text round-trips), followed by a few special tokens.
It is saved as a transformers `PreTrainedTokenizerFast` with a ChatML-style chat template, so
`AutoTokenizer.from_pretrained(dir).apply_chat_template(...)` works on it like on a Hub model.
"""

from __future__ import annotations

import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "build_byte_tokenizer"]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]

# ChatML. Tools (a list of JSON schemas) are listed in the system turn; assistant tool calls are
# rendered as <tool_call>{json}</tool_call> and tool results come back as role "tool".
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{{ '\n\n' }}{% endif %}"
    "Tools:{% for t in tools %}{{ '\n' }}{{ t | tojson }}{% endfor %}{{ '\n' }}"
    'Call a tool with <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for m in messages %}"
    "{% if not (tools and loop.first and m.role == 'system') %}"
    "<|im_start|>{{ m.role }}\n{{ m.content if m.content is string else '' }}"
    "{% for c in (m.tool_calls or []) %}"
    "<tool_call>{{ {'name': (c.function or c).name, 'arguments': (c.function or c).arguments} | tojson "
    "}}</tool_call>{% endfor %}<|im_end|>{{ '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\n' }}{% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte-to-printable-character table used by the ByteLevel pre-tokenizer."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: id == byte value for 0-255, then SPECIAL_TOKENS (vocab size 260)."""
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    for i, tok in enumerate(SPECIAL_TOKENS):
        vocab[tok] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        model_max_length=1 << 20,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_byte_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerFast:
    tok = build_byte_tokenizer()
    tok.save_pretrained(str(path))
    return tok
