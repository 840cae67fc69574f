"""MLA in the latent space and DSA over selected keys: equal to the expanded, dense-masked
reference in values and gradients, linear in memory, with the indexer frozen."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import asyncrl.model.latent_attention as latent_attention
import asyncrl.model.sparse_index as sparse_index
from asyncrl.model import ModelArgs, Transformer, preset_args
from asyncrl.model.latent_attention import sparse_latent_attention
from asyncrl.model.layers import PackedCausalAttention

# tiny-glm5 with index_topk 8 and a "shared" layer that reuses the selection of the layer below
GLM5 = replace(preset_args("tiny-glm5"), index_topk=8, indexer_types=("full", "shared", "full", "full"))


def _reference(q_NHc, kv_Pc, rows_NK, value_dim, scale):
    """Gather every query's rows, softmax over the valid ones, in plain autograd ops."""
    rows_NKc = kv_Pc[rows_NK.clamp(min=0).long()]
    s_NHK = torch.einsum("nhc,nkc->nhk", q_NHc, rows_NKc) * scale
    p_NHK = s_NHK.masked_fill((rows_NK < 0)[:, None], float("-inf")).softmax(-1)
    return torch.einsum("nhk,nkr->nhr", p_NHK, rows_NKc[..., :value_dim])


def test_sparse_kernel_values_and_gradients_equal_plain_autograd(monkeypatch):
    monkeypatch.setattr(latent_attention, "CPU_GATHER_ELEMENTS", 5 * 6 * 10)  # chunks of 5 queries
    gen = torch.Generator().manual_seed(0)
    N, H, P, K, c, R = 23, 3, 40, 6, 10, 7
    q = torch.randn(N, H, c, generator=gen, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(P, c, generator=gen, dtype=torch.float64, requires_grad=True)
    rows = torch.randint(0, P, (N, K), generator=gen, dtype=torch.int32)
    rows[::3, 4:] = -1  # some queries see fewer keys
    rows[1, :] = 5  # one row chosen repeatedly: its gradients add up
    got = sparse_latent_attention(q, kv, rows, value_dim=R, scale=0.3)
    want = _reference(q, kv, rows, R, 0.3)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    grad_out = torch.randn(N, H, R, generator=gen, dtype=torch.float64)
    got_grads = torch.autograd.grad(got, (q, kv), grad_out)
    want_grads = torch.autograd.grad(want, (q, kv), grad_out)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


def _model(args: ModelArgs, seed: int = 1) -> Transformer:
    m = Transformer(args)
    m.init_weights(seed=seed, std=0.08)
    return m


def _run(model, ids, positions, sparse: bool):
    model.zero_grad()
    out = model(ids, positions, attention=PackedCausalAttention(positions, sparse=sparse)).logits
    out.logsumexp(-1).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads


@pytest.mark.parametrize("lengths", [[5], [8], [9], [40], [25, 3, 30]])
def test_sparse_dsa_logits_and_gradients_equal_the_dense_masked_reference(lengths):
    """At every length (shorter than, equal to and past index_topk, packed rows), fp32."""
    model = _model(GLM5)
    T = sum(lengths)
    ids = torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(T))
    positions = torch.cat([torch.arange(n) for n in lengths]).expand(2, T)
    sparse, sparse_grads = _run(model, ids, positions, sparse=True)
    dense, dense_grads = _run(model, ids, positions, sparse=False)
    assert (sparse - dense).abs().max() <= 2e-5
    assert sparse_grads.keys() == dense_grads.keys()
    for name, g in dense_grads.items():
        assert (sparse_grads[name] - g).abs().max() <= 1e-6 + 1e-4 * g.abs().max(), name
    assert sparse_grads["model.layers.1.self_attn.kv_b_proj.weight"].abs().sum() > 0


def test_the_indexer_is_frozen_in_training():
    """The indexer does not require grad and gets none, so an optimizer step (weight decay too)
    leaves it unchanged."""
    model = _model(GLM5)
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(0))
    model(ids).logits.logsumexp(-1).mean().backward()
    indexer = {n: p for n, p in model.named_parameters() if ".indexer." in n}
    assert indexer and all(not p.requires_grad and p.grad is None for p in indexer.values())
    assert all(p.requires_grad for n, p in model.named_parameters() if n not in indexer)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1).step()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) == (n in indexer), n


class _LargestAllocation(TorchDispatchMode):
    """Records the largest storage any op produces (views count as their storage, not their shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.nbytes = max(self.nbytes, t.untyped_storage().nbytes())
        return out


def test_sparse_training_step_never_builds_a_query_by_key_tensor(monkeypatch):
    """Forward and backward at 1024 tokens: nothing of [T, S] size (a bool mask would be 1 MiB),
    while the dense reference does build one. The chunk budgets are lowered to 128 KiB and 64 KiB,
    below the largest per-token tensors (the MoE's [T * top_k, D], 256 KiB)."""
    monkeypatch.setattr(sparse_index, "CPU_SCORE_ELEMENTS", 2**15)
    monkeypatch.setattr(latent_attention, "CPU_GATHER_ELEMENTS", 2**14)
    args = replace(
        GLM5, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=8, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=8, moe_intermediate_size=16, index_n_heads=2, index_head_dim=8, index_topk=16,
        indexer_types=("full", "full"),
    )  # fmt: skip
    model = _model(args)
    T = 1024
    ids = torch.randint(0, 256, (1, T), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(T)[None]
    sizes = {}
    for sparse in (True, False):
        with _LargestAllocation() as largest:
            out = model(ids, positions, attention=PackedCausalAttention(positions, sparse=sparse),
                        compute_logits=False)  # fmt: skip
            out.hidden_states.square().mean().backward()
        sizes[sparse] = largest.nbytes
    assert sizes[True] < T * T // 2 < T * T <= sizes[False]
