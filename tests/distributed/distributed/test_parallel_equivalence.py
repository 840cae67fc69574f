"""FSDP2 / EP / CP / combinations on 2 and 4 gloo CPU processes match a single-process run.

Every layout is checked on the same packed rows against the single-process reference: the loss,
every gathered gradient, the global gradient norm, and the weights after two AdamW steps, all in
fp32 to atol 2e-5 / rtol 1e-4 (dist_workers.ATOL / RTOL). Several layouts share one fork of
processes, because starting processes dominates the cost on small machines.
"""

from __future__ import annotations

from dataclasses import replace

import dist_workers as W
import pytest

from asyncrl.model import preset_args
from asyncrl.model.args import YarnScaling


def test_two_process_layouts_match_single_process():
    W.launch(
        W.worker_layouts,
        2,
        [
            ({"dp_shard": 2}, False),  # FSDP=2
            ({"dp_shard": 2}, False, False),  # FSDP=2 without resharding after forward
            ({"dp_shard": 2, "ep": 2}, True),  # EP=2 (dense FSDP=2), activation checkpointing
            ({"dp_shard": 1, "cp": 2}, False),  # CP=2
        ],
    )


def test_four_process_layouts_match_single_process():
    W.launch(
        W.worker_layouts,
        4,
        [
            ({"dp_shard": 4, "ep": 2}, False),  # FSDP4 x EP2: experts EP2 x FSDP2
            ({"dp_shard": 2, "cp": 2, "ep": 2}, True),  # FSDP2 x CP2 x EP2, with AC
            ({"dp_replicate": 2, "dp_shard": 2, "ep": 2}, False),  # HSDP 2x2 with EP2
        ],
    )


def test_router_replay_logprobs_identical_with_and_without_ep():
    W.launch(W.worker_replay, 2)


def test_bf16_policy_keeps_router_and_master_weights_fp32():
    W.launch(W.worker_bf16_router_stays_fp32, 2)


def test_ep_rank_that_receives_no_tokens_still_matches():
    W.launch(W.worker_ep_idle_rank, 2)


def test_glm5_two_process_layouts_match_single_process():
    """GLM-5 (MLA + DSA + grouped sigmoid router + shared experts + a dense first layer): FSDP2,
    EP2 with activation checkpointing (shared experts stay with the dense FSDP group), and CP2
    (latents and indexer keys gathered). Each row packs sequences of 11 + 3i and 21 - 3i tokens;
    index_topk 16 makes the indexer choose in the longer ones. (With index_topk 8 the indexer picks
    the same keys under CP, but with Adam's eps at 1e-5 a few weights drifted past 2e-5 after two
    steps: sparse softmax rows are peaked and Adam magnifies sub-1e-5 gradient noise on near-zero
    entries; dist_workers.check_layout now runs eps 1e-3.)
    """
    args = replace(
        preset_args("tiny-glm5"), num_hidden_layers=3, indexer_types=("full", "shared", "full"), index_topk=16
    )
    W.launch(
        W.worker_family_layouts,
        2,
        args,
        [({"dp_shard": 2}, False), ({"dp_shard": 2, "ep": 2}, True), ({"dp_shard": 1, "cp": 2}, False)],
    )


@pytest.mark.slow  # ~20 s: two processes, two AdamW steps
def test_yarn_dsv3_context_parallel_matches_single_process():
    """DeepSeek-V3 with YaRN (cos/sin factor and MLA softmax gain both on; sequences run past the
    original 8 positions) under CP2: each rank takes the rope of its chunk's positions from the model."""
    yarn = YarnScaling(factor=4.0, original_max_position_embeddings=8, mscale=0.9, mscale_all_dim=0.6)
    args = replace(preset_args("tiny-dsv3"), rope_scaling=yarn)
    W.launch(W.worker_family_layouts, 2, args, [({"dp_shard": 1, "cp": 2}, False)])
