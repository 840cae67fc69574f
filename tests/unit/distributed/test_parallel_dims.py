"""ParallelDims: resolution of dp_shard = -1 and errors that name the constraint, before any process group."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from asyncrl.distributed import ParallelDims, ParallelDimsError


def test_auto_dp_shard_fills_the_world():
    dims = ParallelDims.build(world_size=16, dp_replicate=2, cp=2, ep=4, num_experts=64)
    assert (dims.dp_shard, dims.dp_size, dims.expert_shard) == (4, 8, 2)
    assert dims.ep_enabled and dims.cp_enabled


def test_rank_coordinates_put_cp_ranks_next_to_each_other():
    dims = ParallelDims.build(world_size=8, dp_replicate=2, dp_shard=2, cp=2)
    assert [dims.coords(r) for r in (0, 1, 2, 5, 7)] == [
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (1, 0, 1),
        (1, 1, 1),
    ]
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [dims.cp_rank(r) for r in range(4)] == [0, 1, 0, 1]


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"world_size": 6, "dp_shard": 4}, "1 * 4 * 1 = 4 must equal world_size (6)"),
        ({"world_size": 6, "cp": 4}, "world_size (6) divisible by dp_replicate * cp = 1 * 4 = 4"),
        ({"world_size": 4, "ep": 3, "num_experts": 8}, "ep (3) must divide num_experts (8)"),
        (
            {"world_size": 4, "ep": 8, "num_experts": 64},
            "ep (8) borrows its ranks from dp_shard * cp = 4 * 1 = 4",
        ),
        ({"world_size": 4, "ep": 2, "num_experts": 0}, "ep = 2 needs an MoE model"),
        ({"world_size": 4, "dp_shard": 0}, "dp_shard must be >= 1 or -1 (auto), got 0"),
        ({"world_size": 4, "cp": 0}, "cp must be >= 1, got 0"),
    ],
)
def test_bad_dims_raise_before_any_process_group(kwargs, fragment):
    with pytest.raises(ParallelDimsError) as info:
        ParallelDims.build(**kwargs)
    assert fragment in str(info.value)
    assert not dist.is_initialized()


def test_ep_may_borrow_cp_ranks():
    dims = ParallelDims.build(world_size=4, dp_shard=1, cp=4, ep=4, num_experts=8)
    assert dims.expert_shard == 1


def test_from_config_reads_the_trainer_parallel_table():
    from asyncrl.config import ParallelConfig, load_config

    cfg = load_config(ParallelConfig, ["--ep", "2", "--cp", "2"])
    dims = ParallelDims.from_config(cfg, world_size=8, num_experts=8)
    assert (dims.dp_shard, dims.ep, dims.cp, dims.expert_shard) == (4, 2, 2, 4)
    with pytest.raises(ParallelDimsError, match=r"ep \(2\) must divide num_experts \(3\)"):
        ParallelDims.from_config(cfg, world_size=8, num_experts=3)
