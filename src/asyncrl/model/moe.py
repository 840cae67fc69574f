"""Mixture-of-Experts block: a softmax top-k router with capture and replay, and grouped experts.

Experts are stacked ([E, ...] parameters) and computed grouped by expert: token copies are sorted
by expert id, each expert runs one matmul over its contiguous slice, and results are unsorted and
summed over the k choices in a fixed order (deterministic, no atomics). In native bf16 on a CPU
outside autograd (the engine's steps), the slices are padded to the largest and each projection is
one batched matmul over all experts (`_use_padded_bmm`). Under inference mode on a CPU, experts of
at least `compute.MIN_PACKED` weights per matrix run instead on oneDNN's packed copies of their
weights, kept between steps: one matmul per expert for gate and up together, one for down.

Router replay (R3): given the expert ids chosen elsewhere (the inference engine), the block uses
them instead of its own top-k, but the gate weights are still this router's softmax probabilities
at those ids, so gradients reach the router. Under replay the router can also report its own
top-k ids (`with_router_topk=True`), so that routing agreement can be measured on the same tokens.
Router and MoE return small NamedTuples (`Routing`, `MoEOutput`) whose fields do not depend on
that flag. NamedTuples, not dataclasses: FSDP2 and activation checkpointing find the tensors in a
module's output through torch's pytree, which knows NamedTuples.

`GroupedExperts.expert_linear` is a hook for the per-expert matmul (`fn(x_NK, w_OK) -> x @ w.T`);
`asyncrl.model.fp8.apply_fp8` sets it to the FP8 block-scale matmul. None keeps the plain path.
`GroupedExperts.cpu_kernel` (an `ExpertsKernel`) computes a whole call where it `takes` it: the
inference engine sets its CPU MoE kernel there (asyncrl.inference.cpu_matmul).

Shape legend: N tokens (flattened), D model dim, E experts, I expert hidden dim, K top_k.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from asyncrl.model.args import ModelArgs
from asyncrl.model.compute import as_fp32, cpu_upcast, kept, pack, packed_linear, packs
from asyncrl.model.layers import MLP

__all__ = [
    "ExpertsKernel",
    "GroupedExperts",
    "MoE",
    "MoEOutput",
    "Router",
    "Routing",
    "RoutingKernel",
    "grouped_swiglu",
]


class Routing(NamedTuple):
    """What a router decided for N tokens (Router.forward)."""

    ids_NK: torch.Tensor  # int64 [N, K]: the experts used (the router's top-k, or the replayed ids)
    weights_NK: torch.Tensor  # [N, K] gate weights in the input's dtype
    router_topk_NK: torch.Tensor | None  # int64 [N, K] the router's own top-k; None unless with_router_topk


class MoEOutput(NamedTuple):
    """An MoE block's output (MoE.forward)."""

    out_BTD: torch.Tensor  # [B, T, D]
    ids_BTK: torch.Tensor  # int64 [B, T, K]: the experts used (captured or replayed)
    router_topk_BTK: (
        torch.Tensor | None
    )  # int64 [B, T, K] the router's own top-k; None unless with_router_topk


class Router(nn.Module):
    """Softmax-then-top-k router (Qwen3-MoE). Logits and probabilities are always computed in fp32."""

    def __init__(self, dim: int, num_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, dim))
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.cpu_kernel: RoutingKernel | None = None

    def forward(
        self, x_ND: torch.Tensor, replay_ids_NK: torch.Tensor | None = None, *, with_router_topk: bool = False
    ) -> Routing:
        """The experts for each token and their gate weights.

        with_router_topk: also report this router's own top-k ids (equal to the ids used unless
        replaying); otherwise `router_topk_NK` is None.
        """
        weight_ED, kernel = as_fp32(self.weight), self.cpu_kernel
        if kernel is not None and replay_ids_NK is None and kernel.takes(x_ND, weight_ED, self.top_k):
            ids_NK, weights_NK = kernel(x_ND, weight_ED, self.top_k, self.norm_topk_prob)
            return Routing(ids_NK, weights_NK, router_topk_NK=ids_NK if with_router_topk else None)
        probs_NE = F.softmax(F.linear(x_ND.float(), weight_ED), dim=-1)
        if replay_ids_NK is None:
            weights_NK, ids_NK = probs_NE.topk(self.top_k, dim=-1)
            own_ids_NK = ids_NK
        else:
            ids_NK = replay_ids_NK.long()
            weights_NK = probs_NE.gather(1, ids_NK)
            own_ids_NK = probs_NE.topk(self.top_k, dim=-1).indices if with_router_topk else None
        if self.norm_topk_prob:
            weights_NK = weights_NK / weights_NK.sum(dim=-1, keepdim=True)
        return Routing(
            ids_NK=ids_NK,
            weights_NK=weights_NK.to(x_ND.dtype),
            router_topk_NK=own_ids_NK if with_router_topk else None,
        )


class RoutingKernel(Protocol):
    """A whole `Router.forward` without replay, computed elsewhere (asyncrl.inference.cpu_matmul)."""

    def takes(self, x_ND: torch.Tensor, weight_ED: torch.Tensor, top_k: int) -> bool: ...

    def __call__(
        self, x_ND: torch.Tensor, weight_ED: torch.Tensor, top_k: int, normalize: bool
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class ExpertsKernel(Protocol):
    """A whole `GroupedExperts.forward` computed elsewhere (asyncrl.inference.cpu_matmul)."""

    def takes(self, x_ND: torch.Tensor, num_experts: int, top_k: int) -> bool: ...

    def __call__(
        self,
        x_ND: torch.Tensor,
        ids_NK: torch.Tensor,
        weights_NK: torch.Tensor,
        gate_EID: torch.Tensor,
        up_EID: torch.Tensor,
        down_EDI: torch.Tensor,
    ) -> torch.Tensor: ...


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored as stacked weights, in HF's (out, in) orientation per expert."""

    def __init__(self, num_experts: int, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_proj = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))  # [E, I, D]
        self.up_proj = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))  # [E, I, D]
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))  # [E, D, I]
        self.expert_linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self.cpu_kernel: ExpertsKernel | None = None

    def forward(self, x_ND: torch.Tensor, ids_NK: torch.Tensor, weights_NK: torch.Tensor) -> torch.Tensor:
        N, K = ids_NK.shape
        kernel = self.cpu_kernel
        if kernel is not None and self.expert_linear is None and kernel.takes(x_ND, self.num_experts, K):
            return kernel(x_ND, ids_NK, weights_NK, self.gate_proj, self.up_proj, self.down_proj)
        flat_ids = ids_NK.reshape(-1)
        order = flat_ids.argsort(stable=True)
        counts_E = torch.bincount(flat_ids, minlength=self.num_experts)
        x_sorted = x_ND.index_select(0, order // K)  # row copies: ~3x faster than x_ND[order // K]
        y_sorted = self._grouped_swiglu(x_sorted, counts_E)
        y_NKD = torch.empty_like(y_sorted).index_copy_(0, order, y_sorted)
        y_NKD = y_NKD.view(N, K, -1) * weights_NK.unsqueeze(-1)
        return y_NKD.sum(dim=1)

    def _grouped_swiglu(self, x_sorted: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        return grouped_swiglu(
            x_sorted, counts_E, self.gate_proj, self.up_proj, self.down_proj, linear=self.expert_linear
        )


def grouped_swiglu(
    x_sorted: torch.Tensor,
    counts_E: torch.Tensor,
    gate_EID: torch.Tensor,
    up_EID: torch.Tensor,
    down_EDI: torch.Tensor,
    linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """SwiGLU of token copies already sorted by expert; counts_E[e] rows belong to expert e.

    Module-free so that an expert-parallel wrapper (asyncrl.distributed) computes its local
    experts with exactly the same arithmetic. `linear(x, w)` replaces `x @ w.T` (FP8 hook).
    """
    if linear is None and packs(x_sorted, gate_EID[0].numel()):
        return _packed_swiglu(x_sorted, counts_E, gate_EID, up_EID, down_EDI)
    if linear is None and _use_padded_bmm(x_sorted, counts_E):
        return _padded_swiglu(x_sorted, counts_E, gate_EID, up_EID, down_EDI)
    if linear is None and cpu_upcast(x_sorted, expert_numel=gate_EID[0].numel()):
        # no native low-precision kernels fast at this size: the whole SwiGLU in fp32, one cast each way
        args = (counts_E, as_fp32(gate_EID), as_fp32(up_EID), as_fp32(down_EDI))
        return grouped_swiglu(x_sorted.float(), *args).to(x_sorted.dtype)
    if linear is None and _use_grouped_mm(x_sorted, gate_EID, down_EDI):
        offs = counts_E.cumsum(0).to(torch.int32)
        gate = F.grouped_mm(x_sorted, gate_EID.transpose(1, 2), offs=offs)
        up = F.grouped_mm(x_sorted, up_EID.transpose(1, 2), offs=offs)
        return F.grouped_mm(F.silu(gate) * up, down_EDI.transpose(1, 2), offs=offs)
    # Otherwise (CPU training outside native bf16, hooked): one matmul per expert over its slice. The
    # weights are split with unbind, not indexed per expert: the backward of `w[e]` zero-fills a
    # whole [E, ...] gradient for every expert and adds them up (E times the weight's size per
    # step; over half of a CPU fwd+bwd), whereas unbind's backward stacks the E slices once.
    mm = linear if linear is not None else _mm_t
    outs = []
    experts = zip(x_sorted.split(counts_E.tolist()), gate_EID.unbind(0), up_EID.unbind(0), down_EDI.unbind(0))
    for x_e, gate_ID, up_ID, down_DI in experts:
        if x_e.shape[0]:
            h = F.silu(mm(x_e, gate_ID)) * mm(x_e, up_ID)
            outs.append(mm(h, down_DI))
    return torch.cat(outs) if outs else x_sorted.new_zeros(x_sorted.shape[0], down_EDI.shape[1])


class MoE(nn.Module):
    """Router + grouped experts (+ always-on shared experts, DeepSeek-style). Returns an `MoEOutput`:
    the output, the expert ids used (captured or replayed), and with `with_router_topk=True` the
    router's own top-k ids.

    `gate` is a softmax `Router` (Qwen3-MoE) or, for the sigmoid-router families, a
    `GroupedSigmoidRouter` (built by `asyncrl.model.transformer`, which picks per architecture).
    """

    def __init__(self, args: ModelArgs, gate: nn.Module | None = None) -> None:
        super().__init__()
        self.gate = gate or Router(
            args.hidden_size, args.num_experts, args.num_experts_per_tok, args.norm_topk_prob
        )
        self.experts = GroupedExperts(args.num_experts, args.hidden_size, args.moe_intermediate_size)
        self.shared_experts = (
            MLP(args.hidden_size, args.moe_intermediate_size * args.n_shared_experts)
            if args.n_shared_experts
            else None
        )

    def forward(
        self,
        x_BTD: torch.Tensor,
        replay_ids_BTK: torch.Tensor | None = None,
        *,
        with_router_topk: bool = False,
    ) -> MoEOutput:
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(-1, D)
        replay_NK = None if replay_ids_BTK is None else replay_ids_BTK.reshape(B * T, -1)
        routing = self.gate(x_ND, replay_NK, with_router_topk=with_router_topk)
        y_BTD = self.experts(x_ND, routing.ids_NK, routing.weights_NK).view(B, T, D)
        if self.shared_experts is not None:
            y_BTD = y_BTD + self.shared_experts(x_BTD)
        own_NK = routing.router_topk_NK
        return MoEOutput(
            out_BTD=y_BTD,
            ids_BTK=routing.ids_NK.view(B, T, -1),
            router_topk_BTK=None if own_NK is None else own_NK.view(B, T, -1),
        )


# A padded batch may hold at most this many rows per real row (skewed routing takes the other paths).
PADDED_BMM_MAX_WASTE = 2


def _use_padded_bmm(x_ND: torch.Tensor, counts_E: torch.Tensor) -> bool:
    """One batched matmul over all experts, each slice padded to the largest: for native bf16 on a
    CPU outside autograd (the engine's steps). oneDNN's bf16 cost per call outweighs a few rows'
    matmul, so 3 calls per layer beat torch's CPU grouped GEMM (3 per expert) and the fp32 path:
    on AVX-512 BF16, 64 tokens top-2 over 8 experts take ~0.3 ms against ~0.45 ms in fp32 at
    128 x 128 experts, and ~3.1 against ~3.5 ms native grouped at 448 x 512. Only while the padding
    at most doubles the rows."""
    if x_ND.device.type != "cpu" or x_ND.dtype != torch.bfloat16 or torch.is_grad_enabled():
        return False
    if cpu_upcast(x_ND) or x_ND.shape[0] == 0:
        return False
    return counts_E.numel() * int(counts_E.max()) <= PADDED_BMM_MAX_WASTE * x_ND.shape[0]


def _padded_swiglu(
    x_sorted: torch.Tensor,
    counts_E: torch.Tensor,
    gate_EID: torch.Tensor,
    up_EID: torch.Tensor,
    down_EDI: torch.Tensor,
) -> torch.Tensor:
    """`grouped_swiglu` as bmm over [E, M, D]: each expert's rows first in its slice, zeros after."""
    E, M, D = counts_E.numel(), int(counts_E.max()), x_sorted.shape[1]
    expert_R = torch.repeat_interleave(torch.arange(E, device=x_sorted.device), counts_E)
    starts_E = counts_E.cumsum(0) - counts_E
    slot_R = expert_R * M + torch.arange(x_sorted.shape[0], device=x_sorted.device) - starts_E[expert_R]
    x_EMD = x_sorted.new_zeros(E, M, D)
    x_EMD.view(-1, D).index_copy_(0, slot_R, x_sorted)
    h_EMI = F.silu(torch.bmm(x_EMD, gate_EID.transpose(1, 2))) * torch.bmm(x_EMD, up_EID.transpose(1, 2))
    y_EMD = torch.bmm(h_EMI, down_EDI.transpose(1, 2))
    return y_EMD.view(-1, down_EDI.shape[1]).index_select(0, slot_R)


def _packed_swiglu(
    x_sorted: torch.Tensor,
    counts_E: torch.Tensor,
    gate_EID: torch.Tensor,
    up_EID: torch.Tensor,
    down_EDI: torch.Tensor,
) -> torch.Tensor:
    """`grouped_swiglu` as one packed matmul per expert for gate and up together, one for down."""
    hidden = gate_EID.shape[1]
    outs = []
    for x_e, (gate_up, down) in zip(
        x_sorted.split(counts_E.tolist()), _packed_experts(gate_EID, up_EID, down_EDI), strict=True
    ):
        if x_e.shape[0]:
            h = packed_linear(x_e, gate_up)
            outs.append(packed_linear(F.silu(h[:, :hidden]) * h[:, hidden:], down))
    return torch.cat(outs) if outs else x_sorted.new_zeros(x_sorted.shape[0], down_EDI.shape[1])


def _packed_experts(
    gate_EID: torch.Tensor, up_EID: torch.Tensor, down_EDI: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per expert: oneDNN's packed [gate; up] ([2I, D]) and down ([D, I]), kept while the three
    weights are unchanged (asyncrl.model.compute)."""

    def make() -> list[tuple[torch.Tensor, torch.Tensor]]:
        experts = zip(gate_EID.unbind(0), up_EID.unbind(0), down_EDI.unbind(0), strict=True)
        return [(pack(torch.cat([g, u])), pack(d)) for g, u, d in experts]

    return kept("packed_experts", make, gate_EID, up_EID, down_EDI)  # type: ignore[return-value]


def _mm_t(x_NK: torch.Tensor, w_OK: torch.Tensor) -> torch.Tensor:
    return x_NK @ w_OK.T


def _use_grouped_mm(x_ND: torch.Tensor, gate_EID: torch.Tensor, down_EDI: torch.Tensor) -> bool:
    """torch's grouped GEMM: on CUDA in bf16; on CPU without autograd (the inference engine), and
    in bf16 training on a CPU with native bf16 kernels.

    On CPU it gives the per-expert loop's results bit for bit (checked in tests) with 3 calls per
    layer instead of 3 per expert, which matters when decoding a few tokens per expert. Under
    autograd in fp32 its forward+backward is no faster than the loop's, so fp32 training keeps the
    loop; in native bf16 (AVX-512 BF16) oneDNN's cost per call makes the loop ~1.7x slower on
    128 x 128 experts, and no faster from 256 x 512 on. It needs 16-byte-aligned rows.
    """
    if not hasattr(F, "grouped_mm"):
        return False
    if x_ND.is_cuda:
        return x_ND.dtype == torch.bfloat16
    row_bytes = (gate_EID.shape[1] * x_ND.element_size(), down_EDI.shape[1] * x_ND.element_size())
    native_bf16 = x_ND.device.type == "cpu" and x_ND.dtype == torch.bfloat16 and not cpu_upcast(x_ND)
    return (native_bf16 or not torch.is_grad_enabled()) and all(b % 16 == 0 for b in row_bytes)
