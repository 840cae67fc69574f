"""The trainer plan's attention, counted as the code computes it: causal per packed sequence, dense
over the row under CP, sparse (index_topk latent rows) for DSA, and the indexer on the busiest rank."""

from __future__ import annotations

import pytest

from asyncrl.model import preset_args
from asyncrl.tools.plan_trainer import (
    Layout,
    _attention_flops,
    _indexer_flops,
    attention_path,
    build_plan,
    causal_keys,
)


def test_causal_keys_count_within_each_packed_sequence_on_the_last_cp_chunk():
    assert causal_keys(seq_tokens=4, row=8, cp=1) == pytest.approx(2.5)  # 1, 2, 3, 4 twice
    assert causal_keys(seq_tokens=8, row=8, cp=1) == pytest.approx(4.5)
    assert causal_keys(seq_tokens=8, row=8, cp=2) == pytest.approx(6.5)  # positions 4..7 see 5..8 keys
    assert causal_keys(seq_tokens=3, row=8, cp=2) == pytest.approx(2.0)  # positions 4..7: 2, 3, 1, 2


def test_each_model_takes_the_attention_path_its_backend_runs():
    dsa, mla, gqa = preset_args("tiny-glm5"), preset_args("tiny-dsv3"), preset_args("tiny-moe")
    assert [attention_path(dsa, 1), attention_path(dsa, 2)] == ["sparse", "sparse"]
    assert [attention_path(mla, 1), attention_path(mla, 2)] == ["causal", "dense"]
    assert [attention_path(gqa, 1), attention_path(gqa, 4)] == ["causal", "dense"]


def test_sparse_attention_flops_are_linear_in_the_row_for_a_fixed_top_k():
    args = preset_args("tiny-glm5")  # 4 heads, latent R 64 + rope 16, top-64
    plan = Layout(nodes=1, gpus_per_node=1, seq_len=256)
    fwd = 2 * 4 * 64 * (80 + 64)  # scores over c = 80 wide rows, values R = 64 wide, 64 keys
    bwd = 2 * 4 * 64 * (3 * 80 + 2 * 64)  # recomputed scores, dq, drows; dp, dvalues
    assert _attention_flops(args, plan) == (2 * fwd + bwd) * 256  # forward twice with recompute
    longer = Layout(nodes=1, gpus_per_node=1, seq_len=512)
    assert _attention_flops(args, longer) == 2 * _attention_flops(args, plan)


def test_dense_masked_attention_gets_no_causal_saving():
    args = preset_args("tiny-moe")  # GQA, 4 heads of 32
    S = 1024
    causal = _attention_flops(args, Layout(nodes=1, gpus_per_node=1, seq_len=S))
    dense = _attention_flops(args, Layout(nodes=1, gpus_per_node=2, seq_len=S, cp=2))
    per_key = 2 * 4 * 2 * 32 * (2 + 2.5)  # q.k and p.v; forward twice, backward 2.5x
    assert causal == pytest.approx(per_key * S * (S + 1) / 2)  # S tokens, (S + 1) / 2 keys each
    assert dense == pytest.approx(per_key * (S / 2) * S)  # S / 2 tokens per rank, S keys each
    # packed rows of shorter sequences attend within each: four 256-token sequences cost a quarter
    packed = _attention_flops(args, Layout(nodes=1, gpus_per_node=1, seq_len=S, seq_tokens=256))
    assert packed == pytest.approx(per_key * S * 257 / 2)


def test_the_indexer_scores_causally_on_the_busiest_cp_rank_in_fp32():
    args = preset_args("tiny-glm5")  # 8 index heads of 32, 4 "full" layers
    layout = Layout(nodes=1, gpus_per_node=2, seq_len=256, cp=2)
    per_score = 2 * 8 * (32 + 1)
    keys = (129 + 256) / 2  # the second chunk: positions 128..255
    assert _indexer_flops(args, layout) == pytest.approx(2 * per_score * keys * 128 * 4)
    plan = build_plan(args, layout)
    assert plan.fp32_flops == pytest.approx(_indexer_flops(args, layout) + 4 * _attention_flops(args, layout))
    no_dsa = build_plan(preset_args("tiny-dsv3"), layout)
    assert no_dsa.fp32_flops == 0 and no_dsa.step_flops > 0
