"""Spawned-process helpers for the distributed tests: gloo on CPU, tiny MoE, packed rows.

Each worker builds the same model and batch as the single-process reference (same seeds), runs a
parallel layout, and asserts against the reference inside the worker; a failure propagates
through torch.multiprocessing.spawn with its traceback.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from asyncrl.distributed import (
    ContextParallelAttention,
    ParallelDims,
    apply_parallelism,
    clip_grad_norm_,
    gather_from_cp,
    gather_to_rank0,
    iter_hf_tensors,
    load_dcp,
    load_full_state_dict,
    save_dcp,
    split_for_cp,
)
from asyncrl.model import Transformer
from asyncrl.model.hf import to_hf_state_dict
from asyncrl.model.presets import preset_args
from asyncrl.trainer.logprobs import chunked_logprobs
from helpers import free_port, run_ranks

ARGS = replace(preset_args("tiny-moe"), num_hidden_layers=2)  # 2 MoE layers of 8 experts, top-2
T = 32  # tokens per packed row
NUM_ROWS = 4
ATOL = 2e-5  # fp32: loss, gradients, weights and logprobs agree to this absolute tolerance
RTOL = 1e-4
AC_PREFIX = "_checkpoint_wrapped_module."


def _entry(rank: int, world_size: int, port: int, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def launch(fn, world_size: int, *args) -> None:
    run_ranks(_entry, world_size, world_size, free_port(), fn, args)


# -- model and data --------------------------------------------------------------------------------
def make_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(ARGS)
    model.init_weights(seed)
    return model


@dataclass(frozen=True, kw_only=True)
class Row:
    input_ids: torch.Tensor  # int64 [1, T]
    position_ids: torch.Tensor  # int64 [1, T]; two packed sequences
    target_ids: torch.Tensor  # int64 [T]
    weights: torch.Tensor  # f32 [T]; advantage * loss mask


def make_rows() -> list[Row]:
    gen = torch.Generator().manual_seed(1234)
    rows = []
    for i in range(NUM_ROWS):
        split = 11 + 3 * i  # sequence boundary not aligned with CP chunks
        pos = torch.cat([torch.arange(split), torch.arange(T - split)])[None]
        mask = torch.rand(T, generator=gen) > 0.3
        adv = torch.randn(T, generator=gen)
        rows.append(
            Row(
                input_ids=torch.randint(0, 256, (1, T), generator=gen),
                position_ids=pos,
                target_ids=torch.randint(0, 256, (T,), generator=gen),
                weights=adv * mask,
            )
        )
    return rows


def logprobs(model, input_ids, position_ids, target_ids, routed=None, attention=None):
    """The trainer's own path: hidden states from the model, then its chunked (recomputed) LM head."""
    out = model(input_ids, position_ids, routed_experts=routed, attention=attention, compute_logits=False)
    temperatures = torch.full(target_ids.shape, 0.9)
    return chunked_logprobs(
        out.hidden_states[0], model.lm_head.weight, target_ids, temperatures, chunk_size=8
    )[0]


def num_loss_tokens(rows: list[Row]) -> float:
    return float(sum(int((r.weights != 0).sum()) for r in rows))


def reference_step(model, rows: list[Row]):
    """Single-process loss over all rows (sum of weighted logprobs / global token count) + backward."""
    count = num_loss_tokens(rows)
    loss = sum(-(logprobs(model, r.input_ids, r.position_ids, r.target_ids) * r.weights).sum() for r in rows)
    loss = loss / count
    loss.backward()
    return loss.detach()


def clean(name: str) -> str:
    return name.replace(AC_PREFIX, "")


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# -- one parallel layout ---------------------------------------------------------------------------
def parallel_step(model, dims: ParallelDims, meshes, rank: int, rows: list[Row]) -> torch.Tensor:
    """This rank's share of the reference loss; backward; returns the global loss (all-reduced)."""
    row = rows[dims.dp_rank(rank)]
    count = num_loss_tokens(rows[: dims.dp_size])
    ids, pos, tgt, w = row.input_ids, row.position_ids, row.target_ids, row.weights
    attention = None
    if dims.cp_enabled:
        cp_rank = dims.cp_rank(rank)
        attention = ContextParallelAttention(pos, meshes.world.get_group("cp"))
        ids, pos = split_for_cp(ids, dims.cp, cp_rank, 1), split_for_cp(pos, dims.cp, cp_rank, 1)
        tgt, w = split_for_cp(tgt, dims.cp, cp_rank, 0), split_for_cp(w, dims.cp, cp_rank, 0)
    loss = -(logprobs(model, ids, pos, tgt, attention=attention) * w).sum() / count
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)  # loss-token counts and loss sums reduce over the whole world
    return total


def check_layout(rank: int, world_size: int, degrees: dict, ac: bool, reshard: bool = True) -> None:
    rows = make_rows()
    dims = ParallelDims.build(world_size=world_size, num_experts=8, **degrees)
    ref = make_model()
    # Adam divides each gradient by about its own size plus eps: at eps 1e-5 a near-zero gradient's
    # fp32 summation-order noise (~1e-8, which differs between layouts) became ~1e-5 of weight after
    # two steps, as large as ATOL. eps 1e-3 leaves the steps large where gradients are.
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-3, weight_decay=0.0)
    model = make_model()
    meshes = dims.build_meshes("cpu")
    apply_parallelism(
        model, dims, meshes, device_type="cpu", activation_checkpointing=ac, reshard_after_forward=reshard
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3, weight_decay=0.0)
    check_expert_placement(model, dims)
    for step in range(2):
        ref_opt.zero_grad()
        opt.zero_grad()
        ref_loss = reference_step(ref, rows[: dims.dp_size])
        loss = parallel_step(model, dims, meshes, rank, rows)
        torch.testing.assert_close(loss, ref_loss, atol=ATOL, rtol=RTOL, msg=f"{degrees} loss, step {step}")
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        for name, p in model.named_parameters():
            g = full(p.grad)
            torch.testing.assert_close(
                g, ref_grads[clean(name)], atol=ATOL, rtol=RTOL, msg=f"{degrees} {name}"
            )
        norm = clip_grad_norm_(list(model.parameters()), 1e9)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
        torch.testing.assert_close(norm, ref_norm, atol=ATOL, rtol=RTOL)
        ref_opt.step()
        opt.step()
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(full(p.detach()), ref_params[clean(name)].detach(), atol=ATOL, rtol=RTOL)


def check_expert_placement(model, dims: ParallelDims) -> None:
    """Under EP each rank really holds num_experts / ep experts (the global shape stays [E, ...])."""
    for name, p in model.named_parameters():
        if ".mlp.experts." not in name:
            continue
        assert p.shape[0] == ARGS.num_experts, name
        if dims.ep_enabled:
            assert p.device_mesh.mesh_dim_names[-1] == "ep" and p.placements[-1] == Shard(0), name
            assert p.to_local().shape[0] == ARGS.num_experts // dims.ep, name


def worker_layouts(rank: int, world_size: int, layouts: list[tuple]) -> None:
    """layouts: (degrees, activation_checkpointing[, reshard_after_forward])."""
    for layout in layouts:
        check_layout(rank, world_size, *layout)


def worker_family_layouts(rank: int, world_size: int, args, layouts: list[tuple]) -> None:
    """`worker_layouts` for another architecture (this forked process's ARGS is replaced)."""
    global ARGS
    ARGS = args
    worker_layouts(rank, world_size, layouts)


def worker_replay(rank: int, world_size: int) -> None:
    """R3: logprobs with replayed routing are identical with and without EP (and CP)."""
    rows = make_rows()
    row = rows[0]
    ref = make_model()
    with torch.no_grad():
        routed = ref(row.input_ids, row.position_ids, return_routing=True).routed_experts
        ref_lp = logprobs(ref, row.input_ids, row.position_ids, row.target_ids, routed=routed)
    for degrees in ({"ep": world_size}, {"ep": world_size, "cp": world_size, "dp_shard": 1}):
        dims = ParallelDims.build(world_size=world_size, num_experts=8, **degrees)
        model = make_model()
        meshes = dims.build_meshes("cpu")
        apply_parallelism(model, dims, meshes, device_type="cpu")
        ids, pos, tgt, r = row.input_ids, row.position_ids, row.target_ids, routed
        attention = None
        if dims.cp_enabled:
            c, group = dims.cp_rank(rank), meshes.world.get_group("cp")
            attention = ContextParallelAttention(pos, group)
            ids, pos, tgt, r = (
                split_for_cp(x, dims.cp, c, d) for x, d in ((ids, 1), (pos, 1), (tgt, 0), (r, 1))
            )
        with torch.no_grad():
            lp = logprobs(model, ids, pos, tgt, routed=r, attention=attention)
        if dims.cp_enabled:
            lp = gather_from_cp(lp, meshes.world.get_group("cp"), dim=0)
        torch.testing.assert_close(lp, ref_lp, atol=ATOL, rtol=RTOL, msg=f"R3 replay {degrees}")


# -- DCP: save at one world size, resume at another ------------------------------------------------
RESUME_ROWS = 2  # every layout below reads the same 2 rows per step (dp_size == 2)


def make_optimizer(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5, weight_decay=0.0)


def reference_two_steps():
    """Single process: two AdamW steps on the resume rows; the weights every resume must reach."""
    rows = make_rows()[:RESUME_ROWS]
    model = make_model()
    opt = make_optimizer(model)
    for _ in range(2):
        opt.zero_grad()
        reference_step(model, rows)
        opt.step()
    return model


def parallel_train_step(model, opt, dims, meshes, rank: int) -> None:
    opt.zero_grad()
    parallel_step(model, dims, meshes, rank, make_rows()[:RESUME_ROWS])
    opt.step()


def worker_dcp_save(rank: int, world_size: int, path: str) -> None:
    """World size 2, FSDP2 x EP2 with AC, full weights broadcast from rank 0: one step, then save."""
    dims = ParallelDims.build(world_size=world_size, dp_shard=2, ep=2, num_experts=8)
    meshes = dims.build_meshes("cpu")
    with torch.device("meta"):
        model = Transformer(ARGS)
    apply_parallelism(model, dims, meshes, device_type="cpu", activation_checkpointing=True)
    model.to_empty(device="cpu")
    load_full_state_dict(model, make_model().state_dict() if rank == 0 else None)  # HF-style weights
    opt = make_optimizer(model)
    parallel_train_step(model, opt, dims, meshes, rank)
    save_dcp(path, model, opt)


def worker_dcp_resume(rank: int, world_size: int, path: str) -> None:
    """World size 4, dp_shard 2 x cp 2 x ep 2, built on meta: load, take step 2, match the reference;
    publish."""
    dims = ParallelDims.build(world_size=world_size, dp_shard=2, cp=2, ep=2, num_experts=8)
    meshes = dims.build_meshes("cpu")
    with torch.device("meta"):  # how a large model is built: no full copy on any rank
        model = Transformer(ARGS)
    apply_parallelism(model, dims, meshes, device_type="cpu")
    model.to_empty(device="cpu")
    model.tie_weights()
    opt = make_optimizer(model)
    load_dcp(path, model, opt)
    parallel_train_step(model, opt, dims, meshes, rank)
    ref = reference_two_steps()
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(full(p.detach()), ref_params[clean(name)].detach(), atol=ATOL, rtol=RTOL)
    published = dict(iter_hf_tensors(model))
    if rank == 0:
        expected = to_hf_state_dict(ref)
        assert published.keys() == expected.keys()
        for key, value in expected.items():
            torch.testing.assert_close(published[key], value.detach(), atol=ATOL, rtol=RTOL)
    else:
        assert published == {}, "only rank 0 receives published tensors"


def worker_bf16_router_stays_fp32(rank: int, world_size: int) -> None:
    """The GPU policy (bf16 params, fp32 reduce) on CPU: blocks compute in bf16, routers in fp32."""
    dims = ParallelDims.build(world_size=world_size, ep=world_size, num_experts=8)
    model = make_model()
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    apply_parallelism(model, dims, dims.build_meshes("cpu"), device_type="cpu", mixed_precision=bf16)
    seen = {}
    for i, layer in enumerate(model.model.layers):
        layer.mlp.gate.register_forward_hook(lambda m, a, o, i=i: seen.update({f"router{i}": m.weight.dtype}))
        layer.self_attn.register_forward_hook(
            lambda m, a, o, i=i: seen.update({f"attn{i}": m.q_proj.weight.dtype})
        )
        layer.mlp.experts.register_forward_hook(lambda m, a, o, i=i: seen.update({f"experts{i}": o.dtype}))
    row = make_rows()[0]
    lp = logprobs(model, row.input_ids, row.position_ids, row.target_ids)
    lp.sum().backward()
    assert all(seen[f"router{i}"] == torch.float32 for i in range(ARGS.num_hidden_layers)), seen
    assert all(
        seen[f"attn{i}"] == seen[f"experts{i}"] == torch.bfloat16 for i in range(ARGS.num_hidden_layers)
    ), seen
    for name, p in model.named_parameters():  # sharded master weights and reduced gradients stay fp32
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32, name


def worker_ep_idle_rank(rank: int, world_size: int) -> None:
    """Replayed routing sends every token to experts 0 and 1 (EP rank 0): EP rank 1 receives no
    tokens, must still join both all_to_alls of the backward, and gets zero expert gradients."""
    rows = make_rows()[:world_size]
    forced = torch.zeros(1, T, ARGS.num_hidden_layers, ARGS.num_experts_per_tok, dtype=torch.int64)
    forced[..., 1] = 1
    count = num_loss_tokens(rows)
    ref = make_model()
    ref_loss = sum(
        -(logprobs(ref, r.input_ids, r.position_ids, r.target_ids, routed=forced) * r.weights).sum()
        for r in rows
    )
    (ref_loss / count).backward()
    dims = ParallelDims.build(world_size=world_size, ep=world_size, num_experts=8)
    model = apply_parallelism(make_model(), dims, dims.build_meshes("cpu"), device_type="cpu")
    row = rows[dims.dp_rank(rank)]
    loss = -(
        logprobs(model, row.input_ids, row.position_ids, row.target_ids, routed=forced) * row.weights
    ).sum()
    (loss / count).backward()
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(full(p.grad), ref_grads[name].grad, atol=ATOL, rtol=RTOL, msg=name)
        if ".mlp.experts." in name:
            assert full(p.grad)[2:].abs().max() == 0  # experts 2..7 saw no tokens


def worker_gather_to_rank0(rank: int, world_size: int) -> None:
    """Uneven shards (5 rows over 2 ranks) and a 2-D mesh with a replicated axis reach rank 0 whole."""
    x = torch.arange(30.0).view(5, 6)
    mesh = DeviceMesh("cpu", torch.arange(world_size))
    out = gather_to_rank0(distribute_tensor(x, mesh, [Shard(0)]))
    assert (out is None) == (rank != 0)
    if rank == 0:
        assert torch.equal(out, x)
    mesh2 = DeviceMesh("cpu", torch.arange(world_size).view(1, world_size), mesh_dim_names=("a", "b"))
    out = gather_to_rank0(distribute_tensor(x, mesh2, [Replicate(), Shard(1)]))
    if rank == 0:
        assert torch.equal(out, x)
