"""Router capture and replay (R3) and packed-sequence attention on the shared model."""

from __future__ import annotations

import pytest
import torch

from asyncrl.model import ModelArgs, PackedCausalAttention, Transformer

ARGS = ModelArgs(
    model_type="qwen3_moe",
    vocab_size=64,
    hidden_size=48,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    num_experts=6,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    norm_topk_prob=True,
    mlp_only_layers=(1,),
)


@pytest.fixture
def model() -> Transformer:
    m = Transformer(ARGS)
    m.init_weights(seed=1, std=0.2)
    return m.eval()


def _ids(shape=(2, 17), seed=0):
    return torch.randint(0, ARGS.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def test_capture_shape_and_dense_layer_zeros(model):
    out = model(_ids(), return_routing=True)
    r = out.routed_experts
    assert r.shape == (2, 17, 3, 2) and r.dtype == torch.int32
    assert torch.all(r[:, :, 1] == 0)  # mlp_only layer
    for layer in (0, 2):
        assert r[:, :, layer].min() >= 0 and r[:, :, layer].max() < ARGS.num_experts
        assert torch.all(r[:, :, layer, 0] != r[:, :, layer, 1])  # top-k picks distinct experts
    # with random weights, tokens do spread over several experts
    assert r[:, :, 0].unique().numel() >= 3


def test_replaying_captured_routing_is_exact(model):
    ids = _ids()
    out = model(ids, return_routing=True)
    replay = model(ids, routed_experts=out.routed_experts, return_routing=True)
    assert torch.equal(replay.logits, out.logits)
    assert torch.equal(replay.routed_experts, out.routed_experts)


def test_replaying_other_routing_changes_logits(model):
    ids = _ids()
    out = model(ids, return_routing=True)
    shifted = out.routed_experts.clone()
    shifted[:, :, [0, 2]] = (shifted[:, :, [0, 2]] + 1) % ARGS.num_experts
    other = model(ids, routed_experts=shifted)
    assert (other.logits - out.logits).abs().max() > 1e-3


def test_gradients_reach_router_under_replay(model):
    ids = _ids()
    routing = model(ids, return_routing=True).routed_experts
    shifted = routing.clone()
    shifted[:, :, 0] = (shifted[:, :, 0] + 3) % ARGS.num_experts
    model.train()
    model(ids, routed_experts=shifted).logits.logsumexp(-1).mean().backward()
    for layer in (0, 2):
        grad = model.layers[layer].mlp.gate.weight.grad
        assert grad is not None and grad.abs().sum() > 0


def test_packed_rows_match_sequences_run_alone(model):
    lengths = [5, 9, 3]
    seqs = [_ids((1, n), seed=i) for i, n in enumerate(lengths)]
    alone = [model(s, return_routing=True) for s in seqs]
    packed_ids = torch.cat(seqs, dim=1)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    packed = model(packed_ids, position_ids=positions, return_routing=True)
    start = 0
    for n, ref in zip(lengths, alone, strict=True):
        got = packed.logits[:, start : start + n]
        assert (got - ref.logits).abs().max() <= 1e-5
        assert torch.equal(packed.routed_experts[:, start : start + n], ref.routed_experts)
        start += n
    # Without restarting positions the same row is one long sequence and the logits differ.
    unpacked = model(packed_ids)
    assert (unpacked.logits[:, 5:14] - alone[1].logits).abs().max() > 1e-3


def test_batched_rows_match_single_rows(model):
    ids = _ids((3, 11), seed=7)
    batched = model(ids).logits
    for b in range(3):
        assert (model(ids[b : b + 1]).logits - batched[b : b + 1]).abs().max() <= 1e-5


@pytest.mark.parametrize(
    "shape, match",
    [((2, 17, 3), r"\[batch, tokens, layers, top_k\]"), ((2, 17, 3, 3), "top_k"), ((1, 17, 3, 2), "got")],
)
def test_wrong_routed_experts_shape_is_a_clear_error(model, shape, match):
    with pytest.raises(ValueError, match=match):
        model(_ids(), routed_experts=torch.zeros(shape, dtype=torch.long))


def test_float_routing_is_rejected(model):
    with pytest.raises(ValueError, match="integer"):
        model(_ids(), routed_experts=torch.zeros(2, 17, 3, 2))


def test_replay_reads_no_expert_id_on_the_host(model, host_reads):
    """The ids are checked where a batch enters (the trainer), not on every forward."""
    ids = _ids()
    routing = model(ids, return_routing=True).routed_experts
    assert host_reads(lambda: model(ids, routed_experts=routing)) == host_reads(lambda: model(ids))


def test_dense_model_rejects_routing():
    dense = Transformer(
        ModelArgs(
            model_type="qwen3",
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
        )
    )
    out = dense(torch.zeros(1, 4, dtype=torch.long), return_routing=True)
    assert out.routed_experts.shape == (1, 4, 1, 1)
    with pytest.raises(ValueError, match="no MoE layers"):
        dense(torch.zeros(1, 4, dtype=torch.long), routed_experts=torch.zeros(1, 4, 1, 1, dtype=torch.long))


def test_router_moe_and_layer_results_have_fixed_fields(model):
    """The with_router_topk flag fills a field; it never changes how many values come back."""
    layer = model.layers[0]
    x_BTD = torch.randn(2, 5, ARGS.hidden_size, generator=torch.Generator().manual_seed(3))
    plain = layer.mlp(x_BTD)
    asked = layer.mlp(x_BTD, with_router_topk=True)
    assert plain.out_BTD.shape == (2, 5, ARGS.hidden_size) and plain.ids_BTK.shape == (2, 5, 2)
    assert plain.router_topk_BTK is None
    assert torch.equal(asked.router_topk_BTK, asked.ids_BTK)  # no replay: the ids used are its own
    replay_BTK = (plain.ids_BTK + 1) % ARGS.num_experts
    replayed = layer.mlp(x_BTD, replay_BTK, with_router_topk=True)
    assert torch.equal(replayed.ids_BTK, replay_BTK) and torch.equal(replayed.router_topk_BTK, plain.ids_BTK)
    routing = layer.mlp.gate(x_BTD.reshape(-1, ARGS.hidden_size))
    assert routing.router_topk_NK is None and routing.weights_NK.dtype == x_BTD.dtype
    torch.testing.assert_close(routing.weights_NK.sum(-1), torch.ones(10))  # norm_topk_prob
    rope = model.rotary(torch.arange(5).expand(2, 5), x_BTD.dtype)
    dense = model.layers[1](
        x_BTD, rope, PackedCausalAttention(torch.arange(5).expand(2, 5)), with_router_topk=True
    )
    assert dense.ids_BTK is None and dense.router_topk_BTK is None and dense.x_BTD.shape == x_BTD.shape
