"""Expert parallel: each EP rank holds num_experts / ep experts, and tokens travel to them.

`ExpertParallelExperts` replaces a `GroupedExperts` module from outside (see `apply_expert_parallel`)
and keeps its call signature, forward(x_ND, ids_NK, weights_NK), so `MoE` and router replay (R3)
are untouched: replayed ids are dispatched exactly like ids the router chose.

One forward, for the token copies of one rank:

1. sort the N*K copies by global expert id (as `GroupedExperts` does);
2. exchange per-expert counts with the other EP ranks (all_to_all of E integers);
3. all_to_all the sorted rows to the ranks owning their experts; the received rows arrive grouped
   by source rank, then local expert, and are regrouped by local expert;
4. run the local experts with `grouped_swiglu` (the model's own arithmetic);
5. undo the regrouping, all_to_all the outputs back, unsort, weight and sum over the K choices.

The all_to_all is an autograd Function whose backward is the reverse all_to_all, so the gradient
of every token copy returns to the rank it came from, and expert weight gradients stay local.

Expert weights are DTensors sharded by expert (Shard(0)) on the `ep` mesh axis, so state dicts
(DCP) see the full [E, ...] tensor and can reshard it to any other layout.

Shape legend: N tokens, D model dim, E experts, El local experts, I expert hidden dim, K top_k,
R EP ranks, M token copies sent, Mr token copies received.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from asyncrl.model.moe import GroupedExperts, MoE, grouped_swiglu

__all__ = ["ExpertParallelExperts", "all_to_all", "apply_expert_parallel"]

_EXPERT_PARAMS = ("gate_proj", "up_proj", "down_proj")


class _AllToAll(torch.autograd.Function):
    """all_to_all_single along dim 0 with uneven splits; backward sends gradients back."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad_in = grad_out.new_empty((sum(ctx.in_splits), *grad_out.shape[1:]))
        dist.all_to_all_single(grad_in, grad_out.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return grad_in, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Differentiable all_to_all_single: rows x[sum(in_splits[:r]):...] go to rank r."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


class ExpertParallelExperts(GroupedExperts):
    """The El = E / ep experts of this EP rank, with the all_to_all dispatch around them."""

    def __init__(self, experts: GroupedExperts, ep_mesh: DeviceMesh) -> None:
        nn.Module.__init__(self)
        ep, ep_rank = ep_mesh.size(), ep_mesh.get_local_rank()
        assert experts.num_experts % ep == 0, "ParallelDims checks that ep divides num_experts"
        self.num_experts, self.num_local = experts.num_experts, experts.num_experts // ep
        self.ep_mesh = ep_mesh
        lo, hi = ep_rank * self.num_local, (ep_rank + 1) * self.num_local
        for name in _EXPERT_PARAMS:
            full = getattr(experts, name).detach()
            local = full[lo:hi].clone()
            shape, stride = full.shape, full.stride()
            dt = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)
            setattr(self, name, nn.Parameter(dt, requires_grad=getattr(experts, name).requires_grad))

    def forward(self, x_ND: torch.Tensor, ids_NK: torch.Tensor, weights_NK: torch.Tensor) -> torch.Tensor:
        N, K = ids_NK.shape
        group, R, El = self.ep_mesh.get_group(), self.ep_mesh.size(), self.num_local
        flat_ids = ids_NK.reshape(-1)
        order = flat_ids.argsort(stable=True)
        counts_E = torch.bincount(flat_ids, minlength=self.num_experts)
        recv_counts_RE = torch.empty_like(counts_E)
        dist.all_to_all_single(recv_counts_RE, counts_E, group=group)
        recv_counts_RE = recv_counts_RE.view(R, El)
        send_splits = counts_E.view(R, El).sum(1).tolist()
        recv_splits = recv_counts_RE.sum(1).tolist()

        x_recv = all_to_all(x_ND[order // K], recv_splits, send_splits, group)
        local_ids = torch.arange(El, device=x_ND.device).repeat(R)
        regroup = torch.repeat_interleave(local_ids, recv_counts_RE.reshape(-1)).argsort(stable=True)
        y_grouped = self._run_local(x_recv[regroup], recv_counts_RE.sum(0))
        y_recv = torch.empty_like(y_grouped)
        y_recv[regroup] = y_grouped
        y_sorted = all_to_all(y_recv, send_splits, recv_splits, group)

        y_NKD = torch.empty_like(y_sorted)
        y_NKD[order] = y_sorted
        y_NKD = y_NKD.view(N, K, -1) * weights_NK.unsqueeze(-1)
        return y_NKD.sum(dim=1)

    def _run_local(self, x_grouped: torch.Tensor, counts_El: torch.Tensor) -> torch.Tensor:
        gate, up, down = (_local(getattr(self, n)) for n in _EXPERT_PARAMS)
        y = grouped_swiglu(x_grouped, counts_El, gate, up, down)
        if x_grouped.shape[0] == 0:
            # No tokens arrived: keep the graph connected so this rank still joins the backward
            # all_to_all and produces (zero) weight gradients like every other rank.
            y = y + 0.0 * (x_grouped.sum() + gate.sum() + up.sum() + down.sum())
        return y


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> int:
    """Swap every MoE layer's `GroupedExperts` for an `ExpertParallelExperts`; return how many."""
    swapped = 0
    for module in model.modules():
        if isinstance(module, MoE) and not isinstance(module.experts, ExpertParallelExperts):
            module.experts = ExpertParallelExperts(module.experts, ep_mesh)
            swapped += 1
    return swapped
