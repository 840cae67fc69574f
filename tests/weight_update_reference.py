"""Reference for keep-mode weight updates, shared by the engine and the HTTP server tests.

A running request keeps the KV cache its old weights computed; after the update the new weights
compute only the positions that follow. `kept_kv_logprobs` computes the logprobs such a request
must report, with a plain dense KV cache, so a test can tell it apart from an engine that
recomputes running requests from scratch under the new weights (`teacher_logprobs` of the new
model). This module sits at the top of tests/ so both test trees import it by name.
"""

from __future__ import annotations

import copy

import torch

from asyncrl.model import Transformer

__all__ = ["DenseKVCache", "kept_kv_logprobs", "perturb_all_weights"]


class DenseKVCache:
    """An attention backend that keeps every key and value fed so far ([B, G, T, Dh] per layer).

    Feeding one model a prefix and then another model the continuation through the same cache
    gives the continuation's outputs with the prefix's KV computed by the first model: what a
    running request sees after a keep-mode weight update.
    """

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def __call__(self, q_BHTd, k_BGTd, v_BGTd, layer_idx: int) -> torch.Tensor:
        if layer_idx in self.k:
            k_BGTd = torch.cat([self.k[layer_idx], k_BGTd], dim=2)
            v_BGTd = torch.cat([self.v[layer_idx], v_BGTd], dim=2)
        self.k[layer_idx], self.v[layer_idx] = k_BGTd, v_BGTd
        num_new, num_all = q_BHTd.shape[2], k_BGTd.shape[2]
        query_pos = torch.arange(num_all - num_new, num_all)[:, None]
        allowed_TS = torch.arange(num_all)[None, :] <= query_pos
        return torch.nn.functional.scaled_dot_product_attention(
            q_BHTd, k_BGTd, v_BGTd, attn_mask=allowed_TS, enable_gqa=q_BHTd.shape[1] != k_BGTd.shape[1]
        )


def kept_kv_logprobs(
    old: Transformer, new: Transformer, prompt: list[int], tokens: list[int], num_old: int, temperature: float
) -> torch.Tensor:
    """Logprobs of tokens[num_old:] when `old` sampled tokens[:num_old] and `new` took over mid-request.

    The KV of prompt + tokens[:num_old - 1] stays as `old` computed it (the last old token is not fed
    yet when the update lands); `new` computes every later position on top of it.
    """
    cache, ctx = DenseKVCache(), prompt + tokens[: num_old - 1]
    with torch.no_grad():
        old(torch.tensor([ctx]), attention=cache, compute_logits=False)
        rest = tokens[num_old - 1 : -1]
        pos = torch.arange(len(ctx), len(ctx) + len(rest))[None]
        logits = new(torch.tensor([rest]), pos, attention=cache).logits[0].float()
    return torch.log_softmax(logits / temperature, dim=-1).gather(1, torch.tensor(tokens[num_old:])[:, None])[
        :, 0
    ]


def perturb_all_weights(model: Transformer, seed: int, scale: float) -> Transformer:
    """A copy with every parameter (norms, router, attention, experts, head) scaled by 1 + scale * N(0, 1)."""
    new = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in new.parameters():
            p.mul_(1 + scale * torch.randn(p.shape, generator=g))
    return new
