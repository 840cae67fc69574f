"""Dense transformer layers: RMSNorm, rotary embeddings, GQA attention with q/k norm, SwiGLU MLP.

Attention math (softmax over keys) is delegated to an `AttentionBackend`, so that the trainer's
packed-sequence attention and the inference engine's paged KV cache share every other line.

Shape legend: B batch, T tokens, D model dim, H query heads, G kv heads, Dh head dim, I mlp dim.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from asyncrl.model import cpu_norm
from asyncrl.model.args import ModelArgs, YarnScaling
from asyncrl.model.compute import Linear, sdpa
from asyncrl.model.latent_attention import LatentProjections, attend_masked, attend_selected
from asyncrl.model.rope import cos_sin_factor, inverse_frequencies
from asyncrl.model.sparse_index import IndexQuery, causal_key_ranges, select_topk

__all__ = [
    "MLP",
    "Attention",
    "AttentionBackend",
    "PackedCausalAttention",
    "RMSNorm",
    "RotaryEmbedding",
    "apply_rope",
    "apply_rope_interleaved",
    "segment_ids_from_positions",
]


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, scaled in the input dtype (as Qwen3 does)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_norm.takes(x, self.weight):
            return cpu_norm.rms_norm(x, self.weight, self.eps)  # a C kernel: one pass each way
        if not torch.is_grad_enabled():
            # torch's fused kernel: the same values bit for bit, ~2x faster per call (decode runs many
            # small ones); under autograd it decomposes into a slower backward, so training keeps ours.
            # It computes a bf16/fp16 input in fp32 and rounds once: no casts around it.
            return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)
        return torch_rms_norm(x, self.weight, self.eps)


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm from torch's ops, differentiable: what `RMSNorm` runs under autograd without the CPU
    kernel (`asyncrl.model.cpu_norm`), and what the kernel's tests hold it to."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """RoPE cos/sin tables [B, T, head_dim] (= cat(freqs, freqs)), built in fp32 from position ids,
    plain or YaRN-scaled (`asyncrl.model.rope`).

    The inverse frequencies are recomputed per call (Dh/2 values) rather than kept in a buffer, so a
    model materialised from the meta device needs no re-initialisation.
    """

    def __init__(self, head_dim: int, theta: float, scaling: YarnScaling | None = None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.factor = cos_sin_factor(scaling)

    def forward(self, position_ids_BT: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = inverse_frequencies(self.head_dim, self.theta, self.scaling, position_ids_BT.device)
        freqs_BTf = position_ids_BT[..., None].float() * inv_freq
        emb_BTd = torch.cat((freqs_BTf, freqs_BTf), dim=-1)
        cos_BTd, sin_BTd = emb_BTd.cos(), emb_BTd.sin()
        if self.factor != 1.0:
            cos_BTd, sin_BTd = cos_BTd * self.factor, sin_BTd * self.factor
        return cos_BTd.to(dtype), sin_BTd.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x_BHTd: torch.Tensor, cos_BTd: torch.Tensor, sin_BTd: torch.Tensor) -> torch.Tensor:
    """Half-split RoPE on the first cos.shape[-1] dims of each head; the rest pass through (partial
    rotary)."""
    cos, sin = cos_BTd.unsqueeze(1), sin_BTd.unsqueeze(1)
    r = cos.shape[-1]
    if r == x_BHTd.shape[-1]:
        return x_BHTd * cos + _rotate_half(x_BHTd) * sin
    x_rot, x_pass = x_BHTd[..., :r], x_BHTd[..., r:]
    return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)


def apply_rope_interleaved(
    x_BHTd: torch.Tensor, cos_BTd: torch.Tensor, sin_BTd: torch.Tensor
) -> torch.Tensor:
    """RoPE over interleaved pairs (x0, x1), (x2, x3), ...; the output is laid out half-split
    ([rotated evens, rotated odds]), as DeepSeek's checkpoints (and transformers) expect."""
    half = cos_BTd.shape[-1] // 2
    cos, sin = cos_BTd[..., :half].unsqueeze(1), sin_BTd[..., :half].unsqueeze(1)
    x1, x2 = x_BHTd[..., 0::2], x_BHTd[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class AttentionBackend(Protocol):
    """Computes softmax attention for one layer. q is [B, H, T, Dh]; k, v are [B, G, T, Dh] (new tokens).

    MLA layers (asyncrl.model.mla) call `attend_latent` instead: they hand over each new token's
    latent state [B, T, c] and themselves as `LatentProjections` (expand the state to per-head K/V,
    or absorb the up-projections into query and output), so that a KV cache can keep the latent;
    `index` (an IndexQuery) makes it DeepSeek sparse attention. It returns per-head outputs
    [B, H, T, v].
    """

    def __call__(
        self, q_BHTd: torch.Tensor, k_BGTd: torch.Tensor, v_BGTd: torch.Tensor, layer_idx: int
    ) -> torch.Tensor: ...

    def attend_latent(
        self,
        q_BHTd: torch.Tensor,
        state_BTc: torch.Tensor,
        mla: LatentProjections,
        layer_idx: int,
        *,
        index: IndexQuery | None = None,
    ) -> torch.Tensor: ...


def segment_ids_from_positions(position_ids_BT: torch.Tensor) -> torch.Tensor:
    """A new segment starts wherever a position does not continue the previous one (+1)."""
    starts_BT = torch.ones_like(position_ids_BT, dtype=torch.bool)
    starts_BT[:, 1:] = position_ids_BT[:, 1:] != position_ids_BT[:, :-1] + 1
    return starts_BT.cumsum(dim=1)


class PackedCausalAttention:
    """Causal attention within each packed sequence of a row, none across sequence boundaries.

    Sequence boundaries are read from the position ids: each packed sequence restarts its positions.
    A row holding one sequence takes one causal SDPA call. A packed row runs one causal call per
    sequence, so the cost is the sum of each sequence's length squared rather than the row's (a
    dense [T, T] block-diagonal mask made SFT on many short sequences 16-20x slower on CPU).

    DSA layers attend each query over its selected keys only (`attend_selected`), the indexer
    ranking the keys of the query's own sequence up to itself; sparse=False runs the dense masked
    reference instead (`attend_masked`: the tests' oracle and the benchmarks' baseline).
    """

    def __init__(self, position_ids_BT: torch.Tensor, *, sparse: bool = True) -> None:
        segments_BT = segment_ids_from_positions(position_ids_BT)
        self.position_ids_BT, self.sparse = position_ids_BT, sparse
        self.dsa_selection: dict[int, torch.Tensor] = {}  # layer -> idx [B, T, K], kept for "shared" layers
        self.bounds: list[list[tuple[int, int]]] | None = None
        if bool((segments_BT[:, -1] > 1).any()):
            T = position_ids_BT.shape[1]
            starts = [
                torch.nonzero(torch.diff(row, prepend=row[:1] - 1)).flatten().tolist() for row in segments_BT
            ]
            self.bounds = [list(zip(st, [*st[1:], T], strict=True)) for st in starts]

    def attend_latent(
        self,
        q_BHTd: torch.Tensor,
        state_BTc: torch.Tensor,
        mla: LatentProjections,
        layer_idx: int,
        *,
        index: IndexQuery | None = None,
    ) -> torch.Tensor:
        if index is None:
            k_BHTd, v_BHTd = mla.expand(state_BTc)
            return self(q_BHTd, k_BHTd, v_BHTd, layer_idx)
        if index.q_BHTd is None:
            idx_BTK = self.dsa_selection[index.source_layer]
        else:
            first_BT, last_BT = causal_key_ranges(self.position_ids_BT)
            idx_BTK = select_topk(index.q_BHTd, index.w_BTH, index.k_BTd, first_BT, last_BT, index.topk)
            if index.reused:
                self.dsa_selection[layer_idx] = idx_BTK
        attend = attend_selected if self.sparse else attend_masked
        return attend(q_BHTd, state_BTc, mla, idx_BTK)

    def __call__(
        self, q_BHTd: torch.Tensor, k_BGTd: torch.Tensor, v_BGTd: torch.Tensor, layer_idx: int
    ) -> torch.Tensor:
        gqa = q_BHTd.shape[1] != k_BGTd.shape[1]
        if self.bounds is None:
            return sdpa(q_BHTd, k_BGTd, v_BGTd, is_causal=True, enable_gqa=gqa)
        rows = []
        for b, segments in enumerate(self.bounds):
            q, k, v = q_BHTd[b : b + 1], k_BGTd[b : b + 1], v_BGTd[b : b + 1]
            parts = [
                sdpa(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True, enable_gqa=gqa)
                for s, e in segments
            ]
            rows.append(torch.cat(parts, dim=2))
        return torch.cat(rows, dim=0)


class Attention(nn.Module):
    """Grouped-query attention with per-head RMSNorm on q and k (Qwen3; optional in GLM-4.5), RoPE
    after the norm, on all (Qwen3) or the first `partial_rotary_factor` (GLM-4.5) of each head's dims."""

    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
        )
        d, bias = args.hidden_size, args.attention_bias
        self.q_proj = Linear(d, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(d, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(d, self.num_kv_heads * self.head_dim, bias=bias)
        o_bias = bias and args.model_type != "glm4_moe"  # GLM-4.5 biases q/k/v only
        self.o_proj = Linear(self.num_heads * self.head_dim, d, bias=o_bias)
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps) if args.use_qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps) if args.use_qk_norm else nn.Identity()

    def forward(
        self,
        x_BTD: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
    ) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        q_BHTd = self.q_norm(self.q_proj(x_BTD).view(B, T, -1, self.head_dim)).transpose(1, 2)
        k_BGTd = self.k_norm(self.k_proj(x_BTD).view(B, T, -1, self.head_dim)).transpose(1, 2)
        v_BGTd = self.v_proj(x_BTD).view(B, T, -1, self.head_dim).transpose(1, 2)
        cos, sin = rope
        q_BHTd, k_BGTd = apply_rope(q_BHTd, cos, sin), apply_rope(k_BGTd, cos, sin)
        o_BHTd = backend(q_BHTd, k_BGTd, v_BGTd, self.layer_idx)
        return self.o_proj(o_BHTd.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.gate_proj = Linear(dim, hidden_dim, bias=False)
        self.up_proj = Linear(dim, hidden_dim, bias=False)
        self.down_proj = Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
