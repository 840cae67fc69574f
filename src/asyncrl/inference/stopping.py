"""When a sequence is done: EOS, stop token ids, stop strings, max_tokens, or the context limit.

Stop strings are matched on the decoded tail of the completion. The tail is long enough for any
stop string when each token decodes to at least a quarter character (true of byte-level and BPE
tokenizers); the token that completes a stop string is kept in the output token ids.
"""

from __future__ import annotations

from collections.abc import Callable

from asyncrl.inference.request import FinishReason, Request

__all__ = ["check_stop"]


def check_stop(
    req: Request,
    eos_token_ids: frozenset[int],
    max_model_len: int,
    detokenize: Callable[[list[int]], str] | None,
) -> FinishReason | None:
    """The finish reason after the latest token was appended, or None to keep generating."""
    opts, token = req.options, req.output_token_ids[-1]
    if (token in eos_token_ids and not opts.ignore_eos) or token in opts.stop_token_ids:
        return FinishReason.STOP
    if opts.stop and detokenize is not None:
        window = 4 * max(len(s) for s in opts.stop) + 8
        tail = detokenize(req.output_token_ids[-window:])
        if any(s in tail for s in opts.stop):
            return FinishReason.STOP
    if len(req.output_token_ids) >= opts.max_tokens or req.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
