"""DeepSeek Sparse Attention as in GLM-5: MLA whose queries attend only to the keys that a cheap
"lightning indexer" ranks highest.

Indexer, per query t and visible key s: score(t, s) = sum_h w_h(x_t) * relu(q_h(t) . k(s)) / sqrt(d),
with index_n_heads query heads from the MLA query latent (wq_b), one shared key per token
(LayerNorm(wk x)), interleaved RoPE on the first qk_rope_head_dim dims of both, and per-head
weights w = weights_proj(x) / sqrt(index_n_heads). Each query keeps its top `index_topk` visible
keys; attention is the MLA attention restricted to those (all of them while a row is shorter
than index_topk). "shared" layers reuse the selection of the nearest "full" layer below.

The indexer runs without gradient, as in transformers (training it needs its own distillation
loss, which is not implemented). The attention backend supplies which keys a query may see
(`visible_mask`), the indexer keys of the whole context (`index_keys`, so a KV cache can keep
them), stores selections for shared layers, and runs the masked attention (`keep_BTS=`).

Shape legend: B batch, T queries, S keys, D model dim, H index heads, d index head dim, k index_topk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from asyncrl.model.args import ModelArgs
from asyncrl.model.layers import AttentionBackend, apply_rope_interleaved
from asyncrl.model.mla import MLAttention

__all__ = ["DSAttention", "Indexer"]


class Indexer(nn.Module):
    """HF names: indexer.wq_b, indexer.wk, indexer.k_norm (LayerNorm, eps 1e-6), indexer.weights_proj."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        assert args.q_lora_rank is not None
        self.num_heads, self.head_dim, self.rope_dim = (
            args.index_n_heads,
            args.index_head_dim,
            args.qk_rope_head_dim,
        )
        self.topk = args.index_topk
        self.wq_b = nn.Linear(args.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(args.hidden_size, self.num_heads, bias=False)

    def _rope(self, x_BHTd: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x_rot, x_pass = x_BHTd.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat((apply_rope_interleaved(x_rot, *rope), x_pass), dim=-1)

    def keys(self, x_BTD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The indexer key of each new token [B, T, d] (what a KV cache keeps next to the latent)."""
        return self._rope(self.k_norm(self.wk(x_BTD)).unsqueeze(1), rope).squeeze(1)

    @torch.no_grad()
    def select(
        self,
        x_BTD: torch.Tensor,
        q_resid_BTQ: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        keys_BSd: torch.Tensor,
        visible_BTS: torch.Tensor,
    ) -> torch.Tensor:
        """Bool [B, T, S]: the visible keys each query attends to (its top index_topk)."""
        B, T, _ = x_BTD.shape
        q_BHTd = self._rope(self.wq_b(q_resid_BTQ).view(B, T, self.num_heads, -1).transpose(1, 2), rope)
        scores_BHTS = F.relu(q_BHTd.float() @ keys_BSd.float().transpose(-1, -2).unsqueeze(1))
        scores_BHTS = scores_BHTS * self.head_dim**-0.5
        w_BTH = self.weights_proj(x_BTD).float() * self.num_heads**-0.5
        index_BTS = torch.einsum("bth,bhts->bts", w_BTH, scores_BHTS)
        index_BTS = index_BTS.masked_fill(~visible_BTS, float("-inf"))
        k = min(self.topk, index_BTS.shape[-1])
        keep_BTS = torch.zeros_like(visible_BTS)
        keep_BTS.scatter_(-1, index_BTS.topk(k, dim=-1).indices, True)
        return keep_BTS & visible_BTS


class DSAttention(MLAttention):
    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__(args, layer_idx)
        full = args.indexer_types[layer_idx] == "full"
        self.indexer = Indexer(args) if full else None
        # the "full" layer whose selection a "shared" layer reuses
        self.source_layer = max(i for i in range(layer_idx + 1) if args.indexer_types[i] == "full")

    def forward(
        self, x_BTD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], backend: AttentionBackend
    ) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        p = self.project(x_BTD, rope)
        if self.indexer is not None:
            keys_BSd = backend.index_keys(self.indexer.keys(x_BTD, rope), self.layer_idx)
            keep_BTS = self.indexer.select(x_BTD, p.q_resid_BTQ, rope, keys_BSd, backend.visible_mask())
            backend.dsa_selection[self.layer_idx] = keep_BTS
        else:
            keep_BTS = backend.dsa_selection[self.source_layer]
        k_BHTd, v_BHTd = self.expand(p.latent_BTR, p.k_rot_BTr)
        o_BHTv = backend(p.q_BHTd, k_BHTd, v_BHTd, self.layer_idx, keep_BTS=keep_BTS)
        return self.o_proj(o_BHTv.transpose(1, 2).reshape(B, T, -1))
