"""DeepSeek-V3's router (also GLM-4.5 and GLM-5): sigmoid scores, a score-correction bias used for
selection only, group-limited top-k, normalised weights scaled by `routed_scaling_factor`.

Selection: each token scores experts with sigmoid(x W^T); the correction bias b (a load-balancing
term, not trained by gradient) is added for choosing only. Experts are split into `n_group` groups,
each group is scored by the sum of its two best biased scores, the best `topk_group` groups stay
eligible and the top-k experts among them are taken. The gate weights are the *unbiased* sigmoid
scores at the chosen ids, normalised to sum to one (norm_topk_prob) and scaled.

Replay (R3) uses the given ids and the same weight rule at those ids, so the gradient reaches the
router weights exactly as it does for the router's own choice. The captured ids are the final ids
after grouping, so replay needs no group information.

Shape legend: N tokens, D model dim, E experts, K top_k, G groups.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from asyncrl.model.args import ModelArgs
from asyncrl.model.compute import as_fp32
from asyncrl.model.moe import Routing

__all__ = ["GroupedSigmoidRouter"]


class GroupedSigmoidRouter(nn.Module):
    """Router with HF names `gate.weight` [E, D] and buffer `gate.e_score_correction_bias` [E]."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        E = args.num_experts
        self.weight = nn.Parameter(torch.zeros(E, args.hidden_size))
        # A buffer, not a parameter: DeepSeek updates it by a balancing rule, never by gradient.
        self.register_buffer("e_score_correction_bias", torch.zeros(E))
        self.num_experts, self.top_k = E, args.num_experts_per_tok
        self.n_group, self.topk_group = args.n_group, args.topk_group
        self.norm_topk_prob, self.scale = args.norm_topk_prob, args.routed_scaling_factor

    def select(self, scores_NE: torch.Tensor) -> torch.Tensor:
        """The router's own top-k ids [N, K] from sigmoid scores (bias added, groups limited)."""
        biased_NE = scores_NE + self.e_score_correction_bias.float()
        if self.n_group > 1:
            N = biased_NE.shape[0]
            grouped_NGe = biased_NE.view(N, self.n_group, -1)
            group_score_NG = grouped_NGe.topk(2, dim=-1).values.sum(dim=-1)
            keep_NG = torch.zeros_like(group_score_NG, dtype=torch.bool)
            keep_NG.scatter_(1, group_score_NG.topk(self.topk_group, dim=-1).indices, True)
            biased_NE = grouped_NGe.masked_fill(~keep_NG.unsqueeze(-1), float("-inf")).view(N, -1)
        return biased_NE.topk(self.top_k, dim=-1).indices

    def forward(
        self, x_ND: torch.Tensor, replay_ids_NK: torch.Tensor | None = None, *, with_router_topk: bool = False
    ) -> Routing:
        scores_NE = torch.sigmoid(F.linear(x_ND.float(), as_fp32(self.weight)))
        if replay_ids_NK is None:
            with torch.no_grad():
                ids_NK = self.select(scores_NE.detach())
            own_NK = ids_NK
        else:
            ids_NK = replay_ids_NK.long()
            own_NK = self.select(scores_NE.detach()) if with_router_topk else None
        weights_NK = scores_NE.gather(1, ids_NK)
        if self.norm_topk_prob:
            weights_NK = weights_NK / (weights_NK.sum(dim=-1, keepdim=True) + 1e-20)
        weights_NK = weights_NK * self.scale
        return Routing(
            ids_NK=ids_NK,
            weights_NK=weights_NK.to(x_ND.dtype),
            router_topk_NK=own_NK if with_router_topk else None,
        )
