"""Mixture-of-Experts block: a softmax top-k router with capture and replay, and grouped experts.

Experts are stacked ([E, ...] parameters) and computed grouped by expert: token copies are sorted
by expert id, each expert runs one matmul over its contiguous slice, and results are unsorted and
summed over the k choices in a fixed order (deterministic, no atomics).

Router replay (R3): given the expert ids chosen elsewhere (the inference engine), the block uses
them instead of its own top-k, but the gate weights are still this router's softmax probabilities
at those ids, so gradients reach the router.

Shape legend: N tokens (flattened), D model dim, E experts, I expert hidden dim, K top_k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from asyncrl.model.args import ModelArgs

__all__ = ["GroupedExperts", "MoE", "Router", "grouped_swiglu"]


class Router(nn.Module):
    """Softmax-then-top-k router (Qwen3-MoE). Logits and probabilities are always computed in fp32."""

    def __init__(self, dim: int, num_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, dim))
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob

    def forward(
        self, x_ND: torch.Tensor, replay_ids_NK: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (expert ids [N, K] int64, gate weights [N, K] in x's dtype)."""
        probs_NE = F.softmax(F.linear(x_ND.float(), self.weight.float()), dim=-1)
        if replay_ids_NK is None:
            weights_NK, ids_NK = probs_NE.topk(self.top_k, dim=-1)
        else:
            ids_NK = replay_ids_NK.long()
            weights_NK = probs_NE.gather(1, ids_NK)
        if self.norm_topk_prob:
            weights_NK = weights_NK / weights_NK.sum(dim=-1, keepdim=True)
        return ids_NK, weights_NK.to(x_ND.dtype)


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored as stacked weights, in HF's (out, in) orientation per expert."""

    def __init__(self, num_experts: int, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_proj = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))  # [E, I, D]
        self.up_proj = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))  # [E, I, D]
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))  # [E, D, I]

    def forward(self, x_ND: torch.Tensor, ids_NK: torch.Tensor, weights_NK: torch.Tensor) -> torch.Tensor:
        N, K = ids_NK.shape
        flat_ids = ids_NK.reshape(-1)
        order = flat_ids.argsort(stable=True)
        counts_E = torch.bincount(flat_ids, minlength=self.num_experts)
        x_sorted = x_ND[order // K]
        y_sorted = self._grouped_swiglu(x_sorted, counts_E)
        y_NKD = torch.empty_like(y_sorted)
        y_NKD[order] = y_sorted
        y_NKD = y_NKD.view(N, K, -1) * weights_NK.unsqueeze(-1)
        return y_NKD.sum(dim=1)

    def _grouped_swiglu(self, x_sorted: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        return grouped_swiglu(x_sorted, counts_E, self.gate_proj, self.up_proj, self.down_proj)


def grouped_swiglu(
    x_sorted: torch.Tensor,
    counts_E: torch.Tensor,
    gate_EID: torch.Tensor,
    up_EID: torch.Tensor,
    down_EDI: torch.Tensor,
) -> torch.Tensor:
    """SwiGLU of token copies already sorted by expert; counts_E[e] rows belong to expert e.

    Module-free so that an expert-parallel wrapper (asyncrl.distributed) computes its local
    experts with exactly the same arithmetic.
    """
    if x_sorted.is_cuda and hasattr(F, "grouped_mm") and x_sorted.dtype == torch.bfloat16:
        offs = counts_E.cumsum(0).to(torch.int32)
        gate = F.grouped_mm(x_sorted, gate_EID.transpose(1, 2), offs=offs)
        up = F.grouped_mm(x_sorted, up_EID.transpose(1, 2), offs=offs)
        return F.grouped_mm(F.silu(gate) * up, down_EDI.transpose(1, 2), offs=offs)
    # CPU / fp32: one matmul per expert over its contiguous slice (grouped_mm lacks CPU backward).
    outs = []
    for e, x_e in enumerate(x_sorted.split(counts_E.tolist())):
        if x_e.shape[0]:
            h = F.silu(x_e @ gate_EID[e].T) * (x_e @ up_EID[e].T)
            outs.append(h @ down_EDI[e].T)
    return torch.cat(outs) if outs else x_sorted.new_zeros(x_sorted.shape[0], down_EDI.shape[1])


class MoE(nn.Module):
    """Router + grouped experts. Returns the output and the expert ids used (captured or replayed)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate = Router(args.hidden_size, args.num_experts, args.num_experts_per_tok, args.norm_topk_prob)
        self.experts = GroupedExperts(args.num_experts, args.hidden_size, args.moe_intermediate_size)

    def forward(
        self, x_BTD: torch.Tensor, replay_ids_BTK: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(-1, D)
        replay_NK = None if replay_ids_BTK is None else replay_ids_BTK.reshape(B * T, -1)
        ids_NK, weights_NK = self.gate(x_ND, replay_NK)
        y_ND = self.experts(x_ND, ids_NK, weights_NK)
        return y_ND.view(B, T, D), ids_NK.view(B, T, -1)
