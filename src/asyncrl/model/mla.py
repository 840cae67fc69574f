"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi-K2, GLM-5).

Keys and values of all heads come from one small per-token latent: c = RMSNorm(W_kva x)[:R] (the
compressed KV, kv_lora_rank R) plus one shared rotary key k_r = RoPE(W_kva x)[R:] (qk_rope_head_dim
r). Per head, k = [W_kb c ; k_r] and v = W_vb c. Queries go through their own low-rank bottleneck
(q_lora_rank) when configured. Only (c, k_r) is per-token state, which is what an MLA KV cache keeps.

`project` returns that per-token state, concatenated [c ; k_r] (`state_BTc`). Attention runs
through `backend.attend_latent(q, state, self, layer)`: the layer lends the backend the maps
between the latent and its heads (`asyncrl.model.latent_attention.LatentProjections`), so a backend
either expands a context's state to per-head K/V (`expand`) or attends in the latent space with
kv_b_proj absorbed into the query (`absorb`) and the output (`project_out`). Both read kv_b_proj's
weight when called, so nothing derived from a weight outlives a weight update; an FP8 kv_b_proj
is read as its forward reads it, so the two forms agree under FP8 too. HF names: q_proj |
q_a_proj, q_a_layernorm, q_b_proj; kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj; o_proj. The two
bottleneck norms use eps 1e-6, as transformers does.

Shape legend: B batch, T tokens, D model dim, H heads, R kv_lora_rank, Q q_lora_rank,
n qk_nope_head_dim, r qk_rope_head_dim, v v_head_dim, c = R + r.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from asyncrl.model.args import ModelArgs
from asyncrl.model.compute import Linear, as_fp32, cpu_upcast
from asyncrl.model.fp8 import FP8Linear
from asyncrl.model.layers import AttentionBackend, RMSNorm, apply_rope, apply_rope_interleaved
from asyncrl.model.rope import softmax_gain

__all__ = ["MLAProjection", "MLAttention"]

_BOTTLENECK_EPS = 1e-6


class MLAProjection(NamedTuple):
    """Queries and the per-token latent state of one MLA layer."""

    q_BHTd: torch.Tensor  # [B, H, T, n + r]: [nope ; roped] per head
    state_BTc: torch.Tensor  # [B, T, R + r]: normed compressed KV ; roped shared key
    q_resid_BTQ: torch.Tensor | None  # [B, T, Q] normed query latent (the DSA indexer reads it)


class MLAttention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        d, H = args.hidden_size, args.num_attention_heads
        self.num_heads, self.kv_lora_rank = H, args.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = (
            args.qk_nope_head_dim,
            args.qk_rope_head_dim,
            args.v_head_dim,
        )
        qk = self.nope_dim + self.rope_dim
        self.softmax_scale = qk**-0.5
        self.q_lora_rank = args.q_lora_rank
        if self.q_lora_rank is None:
            self.q_proj = Linear(d, H * qk, bias=False)
        else:
            self.q_a_proj = Linear(d, self.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, _BOTTLENECK_EPS)
            self.q_b_proj = Linear(self.q_lora_rank, H * qk, bias=False)
        self.kv_a_proj_with_mqa = Linear(d, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, _BOTTLENECK_EPS)
        self.kv_b_proj = Linear(self.kv_lora_rank, H * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = Linear(H * self.v_dim, d, bias=False)
        self._rope = apply_rope_interleaved if args.rope_interleave else apply_rope
        # YaRN's larger softmax scale, folded into the queries so every attention backend keeps its own
        self.softmax_gain = softmax_gain(args)

    def project(self, x_BTD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> MLAProjection:
        B, T, _ = x_BTD.shape
        cos, sin = rope
        if self.q_lora_rank is None:
            q_resid, q = None, self.q_proj(x_BTD)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(x_BTD))
            q = self.q_b_proj(q_resid)
        q_BHTd = q.view(B, T, self.num_heads, -1).transpose(1, 2)
        q_nope, q_rot = q_BHTd.split([self.nope_dim, self.rope_dim], dim=-1)
        q_BHTd = torch.cat((q_nope, self._rope(q_rot, cos, sin)), dim=-1)
        if self.softmax_gain != 1.0:
            q_BHTd = q_BHTd * self.softmax_gain
        latent_BTR, k_rot_BTr = self.kv_a_proj_with_mqa(x_BTD).split(
            [self.kv_lora_rank, self.rope_dim], dim=-1
        )
        k_rot_BTr = self._rope(k_rot_BTr.unsqueeze(1), cos, sin).squeeze(1)
        return MLAProjection(q_BHTd, torch.cat((self.kv_a_layernorm(latent_BTR), k_rot_BTr), dim=-1), q_resid)

    def expand(self, state_BTc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head keys [B, H, T, n + r] and values [B, H, T, v] from the latent state."""
        B, T, _ = state_BTc.shape
        latent_BTR, k_rot_BTr = state_BTc.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv_BHTd = self.kv_b_proj(latent_BTR).view(B, T, self.num_heads, -1).transpose(1, 2)
        k_nope, v_BHTd = kv_BHTd.split([self.nope_dim, self.v_dim], dim=-1)
        k_rot = k_rot_BTr.unsqueeze(1).expand(-1, self.num_heads, -1, -1)
        return torch.cat((k_nope, k_rot), dim=-1), v_BHTd

    def _up_weight(self, like: torch.Tensor) -> torch.Tensor:
        """kv_b_proj's weight [H, n + v, R] as its forward multiplies by it, in its compute dtype."""
        if isinstance(self.kv_b_proj, FP8Linear):
            w = self.kv_b_proj.rounded_weight()
        else:
            w = as_fp32(self.kv_b_proj.weight) if cpu_upcast(like) else self.kv_b_proj.weight
        return w.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)

    def latent(self, state_BSc: torch.Tensor) -> torch.Tensor:
        """The state as kv_b_proj reads it: fp32 and e4m3-rounded where kv_b_proj is FP8, else as is."""
        if not isinstance(self.kv_b_proj, FP8Linear):
            return state_BSc
        latent_BSR, k_rot_BSr = state_BSc.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        return torch.cat((self.kv_b_proj.rounded_input(latent_BSR), k_rot_BSr.float()), dim=-1)

    def absorb(self, q_BHTd: torch.Tensor) -> torch.Tensor:
        """Queries in the latent space [B, H, T, R + r]: [W_kb^T q_nope ; q_rope] per head."""
        q_nope, q_rot = q_BHTd.split([self.nope_dim, self.rope_dim], dim=-1)
        w_kb_HnR = self._up_weight(q_BHTd)[:, : self.nope_dim]
        q_lat = torch.einsum("bhtn,hnr->bhtr", q_nope.to(w_kb_HnR.dtype), w_kb_HnR)
        return torch.cat((q_lat.to(q_BHTd.dtype), q_rot), dim=-1)

    def project_out(self, o_BHTR: torch.Tensor) -> torch.Tensor:
        """Per-head outputs [B, H, T, v] = W_vb o from attention outputs in the latent space."""
        w_vb_HvR = self._up_weight(o_BHTR)[:, self.nope_dim :]
        return torch.einsum("bhtr,hvr->bhtv", o_BHTR.to(w_vb_HvR.dtype), w_vb_HvR).to(o_BHTR.dtype)

    def forward(
        self, x_BTD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], backend: AttentionBackend
    ) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        p = self.project(x_BTD, rope)
        o_BHTv = backend.attend_latent(p.q_BHTd, p.state_BTc, self, self.layer_idx)
        return self.o_proj(o_BHTv.transpose(1, 2).reshape(B, T, -1))
