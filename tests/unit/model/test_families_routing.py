"""Router capture and replay (R3) and packed rows for the sigmoid-router families (DeepSeek-V3,
GLM-4.5, GLM-5), as test_routing.py does for Qwen3-MoE."""

from __future__ import annotations

import pytest
import torch

from asyncrl.model import ModelArgs, Transformer
from asyncrl.model.sparse_index import causal_key_ranges, select_topk

_COMMON = dict(
    vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=4, head_dim=8, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24,
    norm_topk_prob=True, n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
    first_k_dense_replace=1,
)  # fmt: skip
_MLA = dict(kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
FAMILIES = {
    "deepseek_v3": ModelArgs(model_type="deepseek_v3", rope_interleave=True, **_COMMON, **_MLA),
    "glm4_moe": ModelArgs(
        model_type="glm4_moe", **(_COMMON | dict(num_key_value_heads=2, head_dim=12)), partial_rotary_factor=0.5
    ),
    "glm_moe_dsa": ModelArgs(
        model_type="glm_moe_dsa", rope_interleave=True, index_topk=5, index_n_heads=4, index_head_dim=12,
        indexer_types=("full", "shared", "full"), **_COMMON, **_MLA,
    ),
}  # fmt: skip


@pytest.fixture(params=list(FAMILIES))
def model(request) -> Transformer:
    m = Transformer(FAMILIES[request.param])
    m.init_weights(seed=1, std=0.2)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, buf in m.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.3)
    return m.eval()


def _ids(shape=(2, 17), seed=0):
    return torch.randint(0, 64, shape, generator=torch.Generator().manual_seed(seed))


def test_capture_shape_dense_zeros_and_group_limit(model):
    r = model(_ids(), return_routing=True).routed_experts
    assert r.shape == (2, 17, 3, 3) and r.dtype == torch.int32
    assert torch.all(r[:, :, 0] == 0)  # first_k_dense_replace = 1
    for layer in (1, 2):
        ids = r[:, :, layer].long()
        assert ids.min() >= 0 and ids.max() < 8
        assert torch.all(ids.sort(-1).values.diff(dim=-1) > 0)  # distinct experts
        groups = (ids // 2).reshape(-1, 3)  # 4 groups of 2 experts, topk_group 2
        assert all(len(set(g.tolist())) <= 2 for g in groups)
        assert ids.unique().numel() >= 4


def test_replaying_captured_routing_is_exact(model):
    ids = _ids()
    out = model(ids, return_routing=True)
    replay = model(ids, routed_experts=out.routed_experts, return_routing=True)
    assert torch.equal(replay.logits, out.logits)
    assert torch.equal(replay.router_topk, out.routed_experts)


def test_replaying_other_routing_changes_logits_and_reports_own_topk(model):
    ids = _ids()
    out = model(ids, return_routing=True)
    shifted = out.routed_experts.clone()
    shifted[:, :, 1:] = (shifted[:, :, 1:] + 1) % 8
    other = model(ids, routed_experts=shifted, return_routing=True)
    assert (other.logits - out.logits).abs().max() > 1e-3
    assert torch.equal(other.routed_experts, shifted)
    # layer 1 sees the same input either way, so its own choice is the captured one
    assert torch.equal(other.router_topk[:, :, 1], out.routed_experts[:, :, 1])


def test_gate_weights_are_unbiased_sigmoid_scores_scaled(model):
    gate = model.layers[1].mlp.gate
    x = torch.randn(10, 48, generator=torch.Generator().manual_seed(3))
    routing = gate(x)
    scores = torch.sigmoid(x @ gate.weight.T).gather(1, routing.ids_NK)
    torch.testing.assert_close(routing.weights_NK, 2.5 * scores / scores.sum(-1, keepdim=True))
    replay = torch.tensor([[0, 1, 7]] * 10)
    replayed = gate(x, replay)  # any ids, even outside the chosen groups: weights at those ids
    s = torch.sigmoid(x @ gate.weight.T)[:, [0, 1, 7]]
    torch.testing.assert_close(replayed.weights_NK, 2.5 * s / s.sum(-1, keepdim=True))


def test_gradients_reach_router_under_replay(model):
    ids = _ids()
    routing = model(ids, return_routing=True).routed_experts
    shifted = routing.clone()
    shifted[:, :, 1] = (shifted[:, :, 1] + 3) % 8
    model.train()
    model(ids, routed_experts=shifted).logits.logsumexp(-1).mean().backward()
    for layer in (1, 2):
        gate = model.layers[layer].mlp.gate
        assert gate.weight.grad is not None and gate.weight.grad.abs().sum() > 0
        assert not gate.e_score_correction_bias.requires_grad


def test_packed_rows_match_sequences_run_alone(model):
    lengths = [5, 9, 3]  # 9 > index_topk (5) for GLM-5
    seqs = [_ids((1, n), seed=i) for i, n in enumerate(lengths)]
    alone = [model(s, return_routing=True) for s in seqs]
    packed_ids = torch.cat(seqs, dim=1)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    packed = model(packed_ids, position_ids=positions, return_routing=True)
    start = 0
    for n, ref in zip(lengths, alone, strict=True):
        assert (packed.logits[:, start : start + n] - ref.logits).abs().max() <= 1e-5
        assert torch.equal(packed.routed_experts[:, start : start + n], ref.routed_experts)
        start += n
    unpacked = model(packed_ids)
    assert (unpacked.logits[:, 5:14] - alone[1].logits).abs().max() > 1e-3


def test_replay_reads_no_expert_id_on_the_host(model, host_reads):
    ids = _ids()
    routing = model(ids, return_routing=True).routed_experts
    assert host_reads(lambda: model(ids, routed_experts=routing)) == host_reads(lambda: model(ids))


def test_indexer_ties_take_the_earliest_keys_whatever_the_context_length():
    """relu makes exact ties common; the trainer (whole row) and the engine (cached context, other
    lengths) must still pick the same keys, so ties go to the earliest positions."""
    q = torch.tensor([[[[1.0, 0.0]]]])  # [B, H, T=1, d]
    w = torch.ones(1, 1, 1)
    keys = torch.tensor(
        [[[-1.0, 0.0], [2.0, 0.0], [-1.0, 0.0], [-3.0, 0.0], [-1.0, 0.0]]]
    )  # scores 0,2,0,0,0

    def keys_seen(first: int, last: int, S: int = 5) -> list[int]:
        idx = select_topk(q, w, keys[:, :S], torch.tensor([[first]]), torch.tensor([[last]]), topk=3)
        return idx[0, 0].tolist()

    assert keys_seen(0, 3, S=4) == keys_seen(0, 3) == [0, 1, 2]
    assert keys_seen(1, 4) == [1, 2, 3]  # keys before `first` are never kept
    assert keys_seen(0, 1) == [0, 1, -1]  # fewer visible keys than topk: -1 fills


def test_indexer_selection_does_not_depend_on_the_query_chunk():
    """Long contexts rank queries a chunk at a time; the chunk size must not change the keys kept."""
    gen = torch.Generator().manual_seed(0)
    B, H, T, d, topk = 2, 4, 40, 8, 6
    q = torch.randn(B, H, T, d, generator=gen)
    keys = torch.randn(B, T, d, generator=gen)
    keys[:, ::5] = 0.0  # every fifth key scores exactly 0 for every query: ties
    w = torch.randn(B, T, H, generator=gen)
    positions = torch.stack([torch.arange(T), torch.cat([torch.arange(13), torch.arange(T - 13)])])
    first, last = causal_key_ranges(positions)  # row 1 packs two sequences: another visibility
    whole = select_topk(q, w, keys, first, last, topk)
    for budget in (1, 7 * H * T, 3 * T * H * T):  # one query per chunk; uneven chunks of 7; rows together
        assert torch.equal(select_topk(q, w, keys, first, last, topk, max_score_elements=budget), whole)
    assert torch.equal((whole >= 0).sum(-1), (last - first + 1).clamp(max=topk))
