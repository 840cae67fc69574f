"""DeepSeek Sparse Attention as in GLM-5: MLA whose queries attend only to the keys that a cheap
"lightning indexer" ranks highest.

Indexer, per query t and visible key s: score(t, s) = sum_h w_h(x_t) * relu(q_h(t) . k(s)) / sqrt(d),
with index_n_heads query heads from the MLA query latent (wq_b), one shared key per token
(LayerNorm(wk x)), interleaved RoPE on the first qk_rope_head_dim dims of both, and per-head
weights w = weights_proj(x) / sqrt(index_n_heads). Each query keeps its top `index_topk` visible
keys (`asyncrl.model.sparse_index.select_topk`, indices, not a mask); attention is the MLA
attention over those keys only, in the latent space (`asyncrl.model.latent_attention`), with
all of them while a context is shorter than index_topk. "shared" layers reuse the selection of
the nearest "full" layer below, as transformers does.

The indexer runs without gradient and is frozen (requires_grad False, so no optimizer holds
it): the selection is discrete, so the policy loss gives it no gradient, and training it needs its
own loss (a KL to the main attention's distribution, as DeepSeek-V3.2 and GLM-5 do in
pre-training), not implemented; docs/trainer.md says why RL leaves it as the checkpoint has it. The attention backend does the
selection because only it knows each query's context: the whole row while training, the cached
prefix plus new tokens in the engine, which caches each token's index key next to its MLA latent.

Shape legend: B batch, T tokens, D model dim, H index heads, d index head dim.
"""

from __future__ import annotations

import torch
from torch import nn

from asyncrl.model.args import ModelArgs
from asyncrl.model.compute import Linear
from asyncrl.model.layers import AttentionBackend, apply_rope_interleaved
from asyncrl.model.mla import MLAttention
from asyncrl.model.sparse_index import IndexQuery

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
        self.wq_b = Linear(args.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.wk = Linear(args.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = Linear(args.hidden_size, self.num_heads, bias=False)
        # Frozen here, where every world size builds it: the optimizer then holds no state for it,
        # so a checkpoint has none to miss on resume (docs/trainer.md says why RL keeps it frozen).
        self.requires_grad_(False)

    def _rope(self, x_BHTd: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x_rot, x_pass = x_BHTd.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat((apply_rope_interleaved(x_rot, *rope), x_pass), dim=-1)

    @torch.no_grad()
    def forward(
        self, x_BTD: torch.Tensor, q_resid_BTQ: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Index queries [B, H, T, d], head weights [B, T, H] and keys [B, T, d] of the new tokens."""
        B, T, _ = x_BTD.shape
        q_BHTd = self._rope(self.wq_b(q_resid_BTQ).view(B, T, self.num_heads, -1).transpose(1, 2), rope)
        k_BTd = self._rope(self.k_norm(self.wk(x_BTD)).unsqueeze(1), rope).squeeze(1)
        w_BTH = self.weights_proj(x_BTD).float() * self.num_heads**-0.5
        return q_BHTd, w_BTH, k_BTd


class DSAttention(MLAttention):
    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__(args, layer_idx)
        full = args.indexer_types[layer_idx] == "full"
        self.indexer = Indexer(args) if full else None
        self.index_topk = args.index_topk
        # the "full" layer whose selection a "shared" layer reuses
        self.source_layer = max(i for i in range(layer_idx + 1) if args.indexer_types[i] == "full")
        # whether a later "shared" layer reuses this layer's selection (only then is it kept)
        later = args.indexer_types[layer_idx + 1 :]
        self.selection_reused = full and bool(later) and later[0] == "shared"

    def forward(
        self, x_BTD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], backend: AttentionBackend
    ) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        p = self.project(x_BTD, rope)
        q, w, k = (None, None, None) if self.indexer is None else self.indexer(x_BTD, p.q_resid_BTQ, rope)
        index = IndexQuery(
            q_BHTd=q, w_BTH=w, k_BTd=k, topk=self.index_topk, source_layer=self.source_layer,
            reused=self.selection_reused,
        )  # fmt: skip
        o_BHTv = backend.attend_latent(p.q_BHTd, p.state_BTc, self, self.layer_idx, index=index)
        return self.o_proj(o_BHTv.transpose(1, 2).reshape(B, T, -1))
