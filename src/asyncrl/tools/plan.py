"""`asyncrl plan`: per-GPU memory and per-step time of a trainer layout, before renting the nodes.

    asyncrl plan --model CONFIG.json --nodes 28 --gpus-per-node 8 --seq-len 65536 \\
        --dp-shard -1 --ep 8 --cp 2

Prints, per GPU: sharded fp32 parameters, gradients and AdamW state; the largest all-gathered
FSDP unit (one decoder layer: attention, router, and the experts this EP rank owns) with one unit
of prefetch, plus its unsharded gradient; activations at the sequence length with and without
activation checkpointing; then the all_to_all volume and a rough step time. It warns, and exits
with status 1, when the layout does not fit in GPU memory. The layout is validated with the same
`ParallelDims` the trainer uses.

The model is a Hugging Face config.json of any family asyncrl.model runs (GQA or MLA, DSA, shared
experts), read for its shapes (`read_model_config`). Every formula is in this file, kept
simple and deliberately a little pessimistic; docs/scaling.md explains them.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from asyncrl.distributed.dims import ParallelDims, ParallelDimsError
from asyncrl.model.args import ModelArgs, ModelConfigError
from asyncrl.model.sparse_index import MAX_SCORE_ELEMENTS

__all__ = [
    "Layout",
    "MemoryPlan",
    "build_plan",
    "format_plan",
    "load_model_config",
    "main",
    "read_model_config",
]

GB = 1e9
_DTYPE_BYTES = {"bf16": 2, "fp32": 4}


@dataclass(frozen=True, kw_only=True)
class Layout:
    """What the planner is asked about. Example: Layout(nodes=4, gpus_per_node=8, seq_len=8192, ep=8)."""

    nodes: int
    gpus_per_node: int
    seq_len: int  # tokens per packed row (one micro-batch), before CP splits it
    dp_replicate: int = 1
    dp_shard: int = -1
    ep: int = 1
    cp: int = 1
    micro_batches: int = 1  # packed rows per GPU per optimizer step
    activation_checkpointing: bool = True
    param_dtype: str = "bf16"  # dtype weights are all-gathered and computed in
    prefetch: int = 1  # FSDP units gathered ahead of the one computing
    gpu_mem_gb: float = 141.0  # H200
    reserve_gb: float = 8.0  # CUDA context, NCCL buffers, allocator fragmentation
    peak_tflops: float = 989.0  # H200 dense bf16
    mfu: float = 0.35
    a2a_gbps: float = 50.0  # per-GPU all_to_all GB/s across nodes (400 Gb/s NIC)
    nvlink_gbps: float = 400.0  # per-GPU all_to_all GB/s when an EP group fits in one node


@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """Per-GPU figures in bytes (memory), bytes per step (traffic) and seconds (time)."""

    dims: ParallelDims
    total_params: int
    active_params: int
    active_params_no_embedding: int  # without the embedding table and LM head
    kv_cache_bytes_per_token: int  # the inference engine's cache, in the compute dtype
    params: float
    grads: float
    optimizer: float
    gathered_layer: float  # the largest FSDP unit, unsharded, in param_dtype
    gathered_with_prefetch: float  # (1 + prefetch) units
    layer_grads: float  # that unit's unsharded gradient, fp32 for the reduce-scatter
    root: float  # embeddings + LM head, kept gathered through the step
    activations_ac: float
    activations_no_ac: float
    all_to_all_bytes: float  # sent per GPU per step
    step_flops: float
    reserve: float
    gpu_mem: float
    activation_checkpointing: bool
    compute_seconds: float
    all_to_all_seconds: float

    @property
    def activations(self) -> float:
        return self.activations_ac if self.activation_checkpointing else self.activations_no_ac

    @property
    def total(self) -> float:
        transient = self.gathered_with_prefetch + self.layer_grads + self.root + self.activations
        return self.params + self.grads + self.optimizer + transient + self.reserve

    @property
    def fits(self) -> bool:
        return self.total <= self.gpu_mem


def _expert_params_per_layer(args: ModelArgs) -> int:
    return args.num_experts * 3 * args.hidden_size * args.moe_intermediate_size


def _layer_unit_params(args: ModelArgs, layer: int, ep: int) -> int:
    """Parameters of one decoder layer's FSDP units when gathered: dense part + this rank's experts."""
    d = args.hidden_size
    dense = args.attention_params() + 2 * d
    if args.is_moe_layer(layer):
        E = args.num_experts
        router = d * E + (E if args.sigmoid_router else 0)  # + correction bias
        shared = 3 * d * args.moe_intermediate_size * args.n_shared_experts
        return dense + router + shared + _expert_params_per_layer(args) // ep
    return dense + 3 * d * args.intermediate_size


def _attention_elements(args: ModelArgs, cp: int) -> tuple[int, int]:
    """Elements one attention block keeps for backward: (per local token, per token of the row).

    The second applies to every token of the row under CP (keys and values are gathered) and is
    folded into the first without CP. MLA keeps the projected latent per local token, and per key
    token the latent, its kv_b_proj expansion and the per-head keys and values built from it.
    """
    d, H = args.hidden_size, args.num_attention_heads
    if not args.uses_mla:
        g, hd = args.num_key_value_heads, args.head_dim
        local = 2 * d + 3 * H * hd + 3 * g * hd  # norm in/out, q (pre/post rope), k, v, attention out
        return local, 2 * g * hd if cp > 1 else 0  # the gathered k, v
    R, r, n, v = args.kv_lora_rank, args.qk_rope_head_dim, args.qk_nope_head_dim, args.v_head_dim
    Q, qk = args.q_lora_rank or 0, n + r
    # norm in/out, q latent + its norm, q before/after rope, kv_a out + latent norm + state, output
    local = 2 * d + 2 * Q + 2 * H * qk + 3 * (R + r) + H * v
    row = (R + r) + H * (n + v) + H * qk + H * v  # state, kv_b_proj out, keys, contiguous values
    return (local, row) if cp > 1 else (local + row, 0)


def _mlp_elements(args: ModelArgs, layer: int) -> tuple[int, int]:
    """(compute-dtype elements, fp32 bytes) one MLP block keeps per token."""
    d = args.hidden_size
    if not args.is_moe_layer(layer):
        return 2 * d + 4 * args.intermediate_size, 0
    k, i = args.num_experts_per_tok, args.moe_intermediate_size
    routed = 2 * d + 3 * k * d + 4 * k * i  # norm, sorted copies, gate/up/act/h, expert outputs
    ns = args.n_shared_experts
    shared = 4 * ns * i + d if ns else 0  # gate/up/act/h of the shared SwiGLU, its output
    return routed + shared, 2 * args.num_experts * 4  # router logits + probabilities in fp32


def _layer_activations(args: ModelArgs, layout: Layout, layer: int, act_bytes: int) -> float:
    """Bytes one layer keeps for backward (no checkpointing) for this GPU's S / cp tokens."""
    tokens, S = layout.seq_len // layout.cp, layout.seq_len
    local, row = _attention_elements(args, layout.cp)
    mlp, fp32_bytes = _mlp_elements(args, layer)
    out = tokens * ((local + mlp) * act_bytes + fp32_bytes) + S * row * act_bytes
    if layout.cp > 1 or args.uses_dsa:
        # SDPA turns an explicit mask (CP's, DSA's selection) into an additive [S/cp, S] tensor
        # in the compute dtype and keeps it for backward
        out += tokens * S * act_bytes
    if args.uses_dsa and args.indexer_types[layer] == "full":
        out += tokens * S  # the selection, bool [S/cp, S]
    return out


def _dsa_transient(args: ModelArgs) -> float:
    """The indexer's scratch while it ranks keys (it keeps nothing for backward): one chunk of fp32
    scores and its relu (asyncrl.model.sparse_index.MAX_SCORE_ELEMENTS)."""
    return 2 * MAX_SCORE_ELEMENTS * 4 if args.uses_dsa else 0.0


def _activations(args: ModelArgs, layout: Layout, act_bytes: int) -> tuple[float, float]:
    """(with, without) activation checkpointing, for one micro-batch of seq_len / cp tokens."""
    tokens = layout.seq_len // layout.cp
    per_layer = [_layer_activations(args, layout, i, act_bytes) for i in range(args.num_hidden_layers)]
    head = tokens * args.hidden_size * act_bytes + 3 * 1024 * args.vocab_size * 4  # hidden + one logits chunk
    # packed-row attention mask, bool [S/cp, S]: held all step under CP, built per layer for DSA
    mask = tokens * layout.seq_len
    if args.uses_dsa:  # selections a later "shared" layer reuses stay for the whole step
        reused = sum(
            1
            for a, b in zip(args.indexer_types, args.indexer_types[1:], strict=False)
            if (a, b) == ("full", "shared")
        )
        mask += reused * tokens * layout.seq_len
    transient = _dsa_transient(args)
    no_ac = sum(per_layer) + head + mask + transient
    ac = (
        args.num_hidden_layers * tokens * args.hidden_size * act_bytes
        + max(per_layer)
        + head
        + mask
        + transient
    )
    return ac, no_ac


def _step_flops(args: ModelArgs, layout: Layout) -> float:
    """6 * active params per token (8 with recompute) + causal attention, for this GPU's tokens;
    MLA under CP also expands the whole row's latent on every rank; the DSA indexer scores every
    visible key, forward only (no gradient)."""
    tokens = layout.seq_len // layout.cp * layout.micro_batches
    S, H, L = layout.seq_len, args.num_attention_heads, args.num_hidden_layers
    passes = 4 if layout.activation_checkpointing else 3  # forward, backward (2x), recompute
    matmul = (8 if layout.activation_checkpointing else 6) * args.num_params(active=True) * tokens
    qk_v = args.qk_head_dim + args.v_head_dim if args.uses_mla else 2 * args.head_dim
    attn_fwd = 2 * H * qk_v * (S / 2) * tokens
    extra_fwd = 0.0
    if args.uses_mla and layout.cp > 1:
        kv_b = 2 * args.kv_lora_rank * H * (args.qk_nope_head_dim + args.v_head_dim)
        extra_fwd += kv_b * (S - layout.seq_len // layout.cp) * layout.micro_batches
    total = matmul + passes * (attn_fwd + extra_fwd) * L
    if args.uses_dsa:
        full = args.indexer_types.count("full")
        index_fwd = 2 * args.index_n_heads * (args.index_head_dim + 1) * S * tokens
        total += (2 if layout.activation_checkpointing else 1) * index_fwd * full
    return total


def _kv_cache_elements_per_token(args: ModelArgs) -> int:
    """What the engine caches per token over all layers: per-head K and V for GQA; the latent and
    rope key (plus the DSA indexer key) for MLA (asyncrl.inference.kv_cache)."""
    if args.uses_mla:
        per_layer = args.kv_lora_rank + args.qk_rope_head_dim + (args.index_head_dim if args.uses_dsa else 0)
    else:
        per_layer = 2 * args.num_key_value_heads * args.head_dim
    return args.num_hidden_layers * per_layer


def _a2a_bandwidth(layout: Layout, ep: int) -> float:
    """EP groups are contiguous ranks, so ep dividing gpus_per_node keeps all_to_all on NVLink."""
    return layout.nvlink_gbps if layout.gpus_per_node % ep == 0 else layout.a2a_gbps


def build_plan(args: ModelArgs, layout: Layout) -> MemoryPlan:
    """All the per-GPU figures for `layout`; raises ParallelDimsError for an invalid layout."""
    world = layout.nodes * layout.gpus_per_node
    dims = ParallelDims.build(
        world_size=world,
        dp_replicate=layout.dp_replicate,
        dp_shard=layout.dp_shard,
        ep=layout.ep,
        cp=layout.cp,
        num_experts=args.num_experts if args.is_moe else 0,
    )
    if layout.seq_len % layout.cp:
        raise ParallelDimsError(f"seq_len ({layout.seq_len}) must be a multiple of cp ({layout.cp})")
    p_bytes = _DTYPE_BYTES[layout.param_dtype]
    total = args.num_params()
    shard = dims.dp_shard * dims.cp  # dense over dp_shard*cp; experts over ep*expert_shard (same product)
    unit = max(_layer_unit_params(args, i, dims.ep) for i in range(args.num_hidden_layers))
    root = args.vocab_size * args.hidden_size * (1 if args.tie_word_embeddings else 2)
    ac, no_ac = _activations(args, layout, p_bytes)
    moe_layers = len(args.moe_layers)
    tokens = layout.seq_len // layout.cp * layout.micro_batches
    passes = 6 if layout.activation_checkpointing else 4  # dispatch+combine: fwd, bwd (+ recompute)
    remote = (dims.ep - 1) / dims.ep
    a2a = tokens * moe_layers * args.num_experts_per_tok * args.hidden_size * p_bytes * passes * remote
    flops = _step_flops(args, layout)
    return MemoryPlan(
        dims=dims,
        total_params=total,
        active_params=args.num_params(active=True),
        active_params_no_embedding=args.num_params(active=True) - root,
        kv_cache_bytes_per_token=_kv_cache_elements_per_token(args) * p_bytes,
        params=total * 4 / shard,
        grads=total * 4 / shard,
        optimizer=total * 8 / shard,
        gathered_layer=unit * p_bytes,
        gathered_with_prefetch=unit * p_bytes * (1 + layout.prefetch),
        layer_grads=unit * 4,
        root=root * p_bytes,
        activations_ac=ac,
        activations_no_ac=no_ac,
        all_to_all_bytes=a2a,
        step_flops=flops,
        reserve=layout.reserve_gb * GB,
        gpu_mem=layout.gpu_mem_gb * GB,
        activation_checkpointing=layout.activation_checkpointing,
        compute_seconds=flops / (layout.peak_tflops * 1e12 * layout.mfu),
        all_to_all_seconds=a2a / (_a2a_bandwidth(layout, dims.ep) * GB),
    )


def format_plan(plan: MemoryPlan, layout: Layout) -> str:
    d = plan.dims
    ac = "on" if plan.activation_checkpointing else "off"
    rows = [
        f"layout: {d.world_size} GPUs = dp_replicate {d.dp_replicate} x dp_shard {d.dp_shard} x cp {d.cp}; "
        f"ep {d.ep} (experts FSDP over {d.expert_shard}); seq_len {layout.seq_len}, "
        f"{layout.micro_batches} micro-batch(es)/GPU, compute {layout.param_dtype}",
        f"model: {plan.total_params / 1e9:.1f}B parameters, {plan.active_params / 1e9:.1f}B active per token "
        f"({plan.active_params_no_embedding / 1e9:.1f}B without embeddings and LM head)",
        "",
        "per-GPU memory                                     GB",
        f"  parameters (fp32, sharded)                 {plan.params / GB:8.1f}",
        f"  gradients (fp32, sharded)                  {plan.grads / GB:8.1f}",
        f"  optimizer (AdamW, 2 x fp32, sharded)       {plan.optimizer / GB:8.1f}",
        f"  largest all-gathered layer                 {plan.gathered_layer / GB:8.1f}",
        f"    with {layout.prefetch} layer(s) of prefetch              "
        f"{plan.gathered_with_prefetch / GB:8.1f}",
        f"  that layer's gradient (fp32 reduce)        {plan.layer_grads / GB:8.1f}",
        f"  embeddings + LM head (gathered)            {plan.root / GB:8.1f}",
        f"  activations, checkpointing on              {plan.activations_ac / GB:8.1f}",
        f"  activations, checkpointing off             {plan.activations_no_ac / GB:8.1f}",
        f"  reserve (context, comm buffers)            {plan.reserve / GB:8.1f}",
        f"  total (checkpointing {ac:>3})                 {plan.total / GB:8.1f}  of {plan.gpu_mem / GB:.0f}",
        "",
        f"all_to_all sent per GPU per step: {plan.all_to_all_bytes / GB:.2f} GB "
        f"(~{plan.all_to_all_seconds:.2f} s at {_a2a_bandwidth(layout, d.ep):g} GB/s)",
        f"compute per GPU per step: {plan.step_flops / 1e15:.1f} PFLOP "
        f"(~{plan.compute_seconds:.1f} s at {layout.mfu:.0%} of {layout.peak_tflops:g} TFLOPS)",
        f"inference KV cache ({layout.param_dtype}): {plan.kv_cache_bytes_per_token / 1e3:.1f} KB per token, "
        f"{plan.kv_cache_bytes_per_token * layout.seq_len / GB:.1f} GB per {layout.seq_len}-token sequence",
    ]
    if not plan.fits:
        rows.append(
            f"WARNING: does not fit: {plan.total / GB:.1f} GB > {plan.gpu_mem / GB:.0f} GB per GPU. "
            "Raise dp_shard (more GPUs), ep (fewer gathered experts), cp (fewer tokens per GPU)"
            + ("." if plan.activation_checkpointing else ", or turn activation checkpointing on.")
        )
    else:
        rows.append(f"fits: {plan.gpu_mem / GB - plan.total / GB:.1f} GB headroom per GPU")
    return "\n".join(rows)


def load_model_config(path: str | Path) -> ModelArgs:
    """ModelArgs from a config.json file (or a directory holding one)."""
    return read_model_config(path)[0]


def read_model_config(path: str | Path) -> tuple[ModelArgs, list[str]]:
    """ModelArgs from a config.json for planning, and notes on what was read differently.

    The plan depends on shapes only: a checkpoint's `quantization_config` (FP8 weights, which
    loading dequantises) is named in the notes and planned as fp32 master weights.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"--model: {path} not found (give a Hugging Face config.json)")
    try:
        cfg = json.loads(path.read_text())
        cfg, notes = _shapes_only(cfg) if isinstance(cfg, dict) else (cfg, [])
        return ModelArgs.from_hf_config(cfg), notes
    except (json.JSONDecodeError, TypeError, ModelConfigError) as e:
        raise ModelConfigError(f"--model {path}: {e}") from None


def _shapes_only(cfg: dict) -> tuple[dict, list[str]]:
    cfg, notes = dict(cfg), []
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "?")
        notes.append(
            f"quantization_config ({method}) ignored: the plan assumes fp32 master weights and "
            "compute in --param-dtype"
        )
    return cfg, notes


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="asyncrl plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face config.json (or its directory)")
    p.add_argument("--nodes", type=int, required=True, help="trainer nodes")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per trainer node")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per packed row")
    p.add_argument("--dp-replicate", type=int, default=1, help="HSDP replicas")
    p.add_argument("--dp-shard", type=int, default=-1, help="-1 = auto")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree")
    p.add_argument("--cp", type=int, default=1, help="context-parallel degree")
    p.add_argument("--micro-batches", type=int, default=1, help="packed rows per GPU per step")
    p.add_argument(
        "--no-activation-checkpointing", action="store_true", help="keep every block's activations"
    )
    p.add_argument(
        "--param-dtype", choices=sorted(_DTYPE_BYTES), default="bf16", help="dtype of gathered weights"
    )
    p.add_argument("--prefetch", type=int, default=1, help="FSDP units gathered ahead of the one computing")
    p.add_argument("--gpu-mem-gb", type=float, default=141.0, help="default: H200")
    p.add_argument(
        "--reserve-gb", type=float, default=8.0, help="CUDA context, NCCL buffers, allocator fragmentation"
    )
    p.add_argument("--mfu", type=float, default=0.35, help="assumed model FLOPs utilisation for step time")
    p.add_argument("--a2a-gbps", type=float, default=50.0, help="per-GPU all_to_all GB/s across nodes")
    p.add_argument("--nvlink-gbps", type=float, default=400.0, help="per-GPU all_to_all GB/s within a node")
    return p


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    layout = Layout(
        nodes=ns.nodes,
        gpus_per_node=ns.gpus_per_node,
        seq_len=ns.seq_len,
        dp_replicate=ns.dp_replicate,
        dp_shard=ns.dp_shard,
        ep=ns.ep,
        cp=ns.cp,
        micro_batches=ns.micro_batches,
        activation_checkpointing=not ns.no_activation_checkpointing,
        param_dtype=ns.param_dtype,
        prefetch=ns.prefetch,
        gpu_mem_gb=ns.gpu_mem_gb,
        reserve_gb=ns.reserve_gb,
        mfu=ns.mfu,
        a2a_gbps=ns.a2a_gbps,
        nvlink_gbps=ns.nvlink_gbps,
    )
    try:
        args, notes = read_model_config(ns.model)
        plan = build_plan(args, layout)
    except (ParallelDimsError, ModelConfigError) as e:
        print(f"asyncrl plan: {e}", file=sys.stderr)
        return 2
    print("".join(f"note: {n}\n" for n in notes) + format_plan(plan, layout))
    return 0 if plan.fits else 1
