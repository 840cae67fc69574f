"""The trainer's side of `asyncrl plan`: per-GPU memory and per-step time of a trainer layout.

Per GPU: sharded fp32 parameters, gradients and AdamW state; the largest all-gathered FSDP unit
(one decoder layer: attention, router, and the experts this EP rank owns) with one unit of
prefetch, plus its unsharded gradient; activations at the sequence length with and without
activation checkpointing; the all_to_all volume and a rough step time. Attention is counted as
the trainer computes it (`attention_path`): causal per packed sequence, dense over the whole row
under context parallel (a boolean mask: no causal saving), sparse for DSA (each query over its
`index_topk` selected keys, in MLA's latent space, in fp32). The layout is validated with the
same `ParallelDims` the trainer uses. Every formula is here, kept simple and deliberately a
little pessimistic; docs/scaling.md explains them.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.distributed.dims import ParallelDims, ParallelDimsError
from asyncrl.model.args import ModelArgs
from asyncrl.model.sparse_index import MAX_SCORE_ELEMENTS

__all__ = [
    "GB",
    "Layout",
    "MemoryPlan",
    "attention_path",
    "build_plan",
    "causal_keys",
    "format_plan",
    "kv_cache_elements_per_token",
]

GB = 1e9
_DTYPE_BYTES = {"bf16": 2, "fp32": 4}


@dataclass(frozen=True, kw_only=True)
class Layout:
    """What the planner is asked about. Example: Layout(nodes=4, gpus_per_node=8, seq_len=8192, ep=8)."""

    nodes: int
    gpus_per_node: int
    seq_len: int  # tokens per packed row (one micro-batch), before CP splits it
    seq_tokens: int | None = None  # tokens per packed sequence (causal attention's span); None: seq_len
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
    fp32_tflops: float = 67.0  # H200 fp32 (CUDA cores): DSA's indexer and latent attention
    dsa_bf16: bool = False  # what-if: DSA's fp32 work on bf16 tensor cores instead
    mfu: float = 0.35
    a2a_gbps: float = 50.0  # per-GPU all_to_all GB/s across nodes (400 Gb/s NIC)
    nvlink_gbps: float = 400.0  # per-GPU all_to_all GB/s when an EP group fits in one node

    @property
    def sequence_tokens(self) -> int:
        return self.seq_len if self.seq_tokens is None else min(self.seq_tokens, self.seq_len)


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
    step_flops: float  # in the compute dtype
    fp32_flops: float  # DSA's indexer scores and latent attention
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


def attention_path(args: ModelArgs, cp: int) -> str:
    """How the trainer's attention runs, which decides what it costs:

    - "sparse": DSA; each query attends over its `index_topk` selected keys only, in MLA's latent
      space (work and memory linear in the row for a fixed top-k);
    - "dense": context parallel; local queries over the whole gathered row with a boolean mask, so
      SDPA computes every (query, key) pair: no causal saving;
    - "causal": SDPA `is_causal` per packed sequence (a flash kernel skips the masked half).
    """
    if args.uses_dsa:
        return "sparse"
    return "dense" if cp > 1 else "causal"


def _causal_sum(n: int, seq_tokens: int) -> int:
    """Keys seen by the first n tokens of a row packed with sequences of seq_tokens: sum (p mod l) + 1."""
    q, r = divmod(n, seq_tokens)
    return q * seq_tokens * (seq_tokens + 1) // 2 + r * (r + 1) // 2


def causal_keys(seq_tokens: int, row: int, cp: int) -> float:
    """Mean keys per query, causal within packed sequences, on the last CP rank's chunk of the row:
    the rank with the most causal work (CP chunks are contiguous), which every other rank waits for."""
    chunk = row // cp
    return (_causal_sum(row, seq_tokens) - _causal_sum(row - chunk, seq_tokens)) / chunk


def _indexer_params(args: ModelArgs) -> int:
    """One DSA indexer: wq_b, wk, k_norm (LayerNorm), weights_proj."""
    ih, idim, d = args.index_n_heads, args.index_head_dim, args.hidden_size
    return (args.q_lora_rank or 0) * ih * idim + d * idim + 2 * idim + d * ih


def _attention_elements(args: ModelArgs, cp: int) -> tuple[int, int]:
    """Elements one attention block keeps for backward: (per local token, per token of the row).

    The second applies to every token of the row under CP (keys and values are gathered) and is
    folded into the first without CP. MLA keeps the projected latent per local token, and per key
    token the latent, its kv_b_proj expansion and the per-head keys and values built from it. DSA
    never expands: it keeps the latent-space queries and outputs per local token and the (gathered)
    latent per key token; its fp32 and integer tensors are in `_sparse_attention_bytes`.
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
    if args.uses_dsa:  # + absorbed queries [H, R + r] and latent outputs [H, R] for project_out
        return local + H * (R + r) + H * R, (R + r) if cp > 1 else 0
    row = (R + r) + H * (n + v) + H * qk + H * v  # state, kv_b_proj out, keys, contiguous values
    return (local, row) if cp > 1 else (local + row, 0)


def _sparse_attention_bytes(args: ModelArgs, seq_len: int) -> int:
    """Bytes per local token a DSA layer keeps besides `_attention_elements`: the latent-space
    outputs in fp32 [H, R] and the rows of its selected keys, int64 [index_topk] (the int32
    selection offset into the flattened batch)."""
    if not args.uses_dsa:
        return 0
    return 4 * args.num_attention_heads * args.kv_lora_rank + 8 * min(args.index_topk, seq_len)


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
    fp32_bytes += _sparse_attention_bytes(args, S)
    out = tokens * ((local + mlp) * act_bytes + fp32_bytes) + S * row * act_bytes
    if attention_path(args, layout.cp) == "dense":
        # SDPA turns CP's boolean mask into an additive [S/cp, S] tensor in the compute dtype and
        # keeps it for backward
        out += tokens * S * act_bytes
    return out


# fp32 elements of latent rows one chunk of sparse attention gathers (asyncrl.model.latent_attention)
_GATHER_ELEMENTS = 2**24


def _dsa_transient(args: ModelArgs) -> float:
    """DSA's scratch (nothing kept for backward): the indexer's chunk of fp32 scores and one head's
    scores (asyncrl.model.sparse_index.MAX_SCORE_ELEMENTS), and sparse attention's chunk of gathered
    latent rows with its scores and probabilities [queries, H, K]."""
    if not args.uses_dsa:
        return 0.0
    H, c = args.num_attention_heads, args.kv_lora_rank + args.qk_rope_head_dim
    return 2 * MAX_SCORE_ELEMENTS * 4 + _GATHER_ELEMENTS * 4 * (1 + 2 * H / c)


def _activations(args: ModelArgs, layout: Layout, act_bytes: int) -> tuple[float, float]:
    """(with, without) activation checkpointing, for one micro-batch of seq_len / cp tokens."""
    tokens = layout.seq_len // layout.cp
    per_layer = [_layer_activations(args, layout, i, act_bytes) for i in range(args.num_hidden_layers)]
    head = tokens * args.hidden_size * act_bytes + 3 * 1024 * args.vocab_size * 4  # hidden + one logits chunk
    # CP's boolean mask rows, [S/cp, S], held all step (DSA layers never build them)
    mask = tokens * layout.seq_len if attention_path(args, layout.cp) == "dense" else 0
    if args.uses_dsa:  # selections a later "shared" layer reuses stay for the whole step: int32 [S/cp, K]
        reused = sum(
            1
            for a, b in zip(args.indexer_types, args.indexer_types[1:], strict=False)
            if (a, b) == ("full", "shared")
        )
        mask += reused * tokens * 4 * min(args.index_topk, layout.seq_len)
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


def _attention_flops(args: ModelArgs, layout: Layout) -> float:
    """One layer's attention FLOPs for this GPU's tokens: forward (twice with recompute) + backward.

    Expanded attention (SDPA) costs 2 * H * (qk + v) per (query, key) forward and 2.5x that
    backward (flash and memory-efficient kernels recompute the scores). DSA's latent attention
    scores each query against its K selected latent rows (width c = R + r) and sums R-wide values:
    2 * H * K * (c + R) forward; its backward recomputes the scores, then dp, dq, drows, dvalues.
    """
    tokens = layout.seq_len // layout.cp * layout.micro_batches
    H, S = args.num_attention_heads, layout.seq_len
    forwards = 2 if layout.activation_checkpointing else 1
    path = attention_path(args, layout.cp)
    if path == "sparse":
        K, R = min(args.index_topk, S), args.kv_lora_rank
        c = R + args.qk_rope_head_dim
        fwd, bwd = 2 * H * K * (c + R), 2 * H * K * (3 * c + 2 * R)
    else:
        keys = S if path == "dense" else causal_keys(layout.sequence_tokens, S, 1)
        qk_v = args.qk_head_dim + args.v_head_dim if args.uses_mla else 2 * args.head_dim
        fwd = 2 * H * qk_v * keys
        bwd = 2.5 * fwd
    return (forwards * fwd + bwd) * tokens


def _indexer_flops(args: ModelArgs, layout: Layout) -> float:
    """The DSA indexer's scores for this GPU's tokens (no gradient; again in the recompute): every
    key a query may see, causal within its sequence, on the busiest CP rank."""
    if not args.uses_dsa:
        return 0.0
    tokens = layout.seq_len // layout.cp * layout.micro_batches
    keys = causal_keys(layout.sequence_tokens, layout.seq_len, layout.cp)
    fwd = 2 * args.index_n_heads * (args.index_head_dim + 1) * keys * tokens
    return (2 if layout.activation_checkpointing else 1) * fwd * args.indexer_types.count("full")


def _step_flops(args: ModelArgs, layout: Layout) -> tuple[float, float]:
    """(compute-dtype FLOPs, fp32 FLOPs) for this GPU's tokens, as the trainer runs them.

    Matmuls: 6 FLOPs per active parameter per token (8 with recompute), except the embedding (a
    lookup), the LM head (8: chunked logprobs recompute it) and the DSA indexer's projections (no
    gradient: 2, or 4 with recompute). MLA under CP (without DSA) also expands the whole row's
    latent on every rank. DSA's indexer scores and latent attention run in fp32 (their kernels
    upcast; TF32 is not enabled), so they are the second figure.
    """
    tokens = layout.seq_len // layout.cp * layout.micro_batches
    S, H, L = layout.seq_len, args.num_attention_heads, args.num_hidden_layers
    ac = layout.activation_checkpointing
    embed = args.vocab_size * args.hidden_size
    head = 0 if args.tie_word_embeddings else embed
    indexer = _indexer_params(args) * args.indexer_types.count("full") if args.uses_dsa else 0
    trained = args.num_params(active=True) - embed - head - indexer
    matmul = ((8 if ac else 6) * trained + 8 * embed + (4 if ac else 2) * indexer) * tokens
    attention = _attention_flops(args, layout) * L
    if args.uses_mla and attention_path(args, layout.cp) == "dense":
        kv_b = 2 * args.kv_lora_rank * H * (args.qk_nope_head_dim + args.v_head_dim)
        matmul += (4 if ac else 3) * kv_b * (S - layout.seq_len // layout.cp) * layout.micro_batches * L
    if args.uses_dsa:
        return matmul, attention + _indexer_flops(args, layout)
    return matmul + attention, 0.0


def kv_cache_elements_per_token(args: ModelArgs) -> int:
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
        world_size=world, dp_replicate=layout.dp_replicate, dp_shard=layout.dp_shard,
        ep=layout.ep, cp=layout.cp, num_experts=args.num_experts if args.is_moe else 0,
    )  # fmt: skip
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
    flops, fp32_flops = _step_flops(args, layout)
    compute_s = flops / (layout.peak_tflops * 1e12 * layout.mfu)
    fp32_peak = layout.peak_tflops if layout.dsa_bf16 else layout.fp32_tflops
    compute_s += fp32_flops / (fp32_peak * 1e12 * layout.mfu)
    return MemoryPlan(
        dims=dims, total_params=total, active_params=args.num_params(active=True),
        active_params_no_embedding=args.num_params(active=True) - root,
        kv_cache_bytes_per_token=kv_cache_elements_per_token(args) * p_bytes,
        params=total * 4 / shard, grads=total * 4 / shard, optimizer=total * 8 / shard,
        gathered_layer=unit * p_bytes, gathered_with_prefetch=unit * p_bytes * (1 + layout.prefetch),
        layer_grads=unit * 4, root=root * p_bytes, activations_ac=ac, activations_no_ac=no_ac,
        all_to_all_bytes=a2a, step_flops=flops, fp32_flops=fp32_flops, reserve=layout.reserve_gb * GB,
        gpu_mem=layout.gpu_mem_gb * GB, activation_checkpointing=layout.activation_checkpointing,
        compute_seconds=compute_s,
        all_to_all_seconds=a2a / (_a2a_bandwidth(layout, dims.ep) * GB),
    )  # fmt: skip


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
        f"    with {layout.prefetch} layer(s) of prefetch              {plan.gathered_with_prefetch / GB:8.1f}",
        f"  that layer's gradient (fp32 reduce)        {plan.layer_grads / GB:8.1f}",
        f"  embeddings + LM head (gathered)            {plan.root / GB:8.1f}",
        f"  activations, checkpointing on              {plan.activations_ac / GB:8.1f}",
        f"  activations, checkpointing off             {plan.activations_no_ac / GB:8.1f}",
        f"  reserve (context, comm buffers)            {plan.reserve / GB:8.1f}",
        f"  total (checkpointing {ac:>3})                 {plan.total / GB:8.1f}  of {plan.gpu_mem / GB:.0f}",
        "",
        f"all_to_all sent per GPU per step: {plan.all_to_all_bytes / GB:.2f} GB "
        f"(~{plan.all_to_all_seconds:.2f} s at {_a2a_bandwidth(layout, d.ep):g} GB/s)",
        _compute_line(plan, layout),
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


def _compute_line(plan: MemoryPlan, layout: Layout) -> str:
    at = f"{layout.mfu:.0%} of {layout.peak_tflops:g} TFLOPS"
    flops = f"{plan.step_flops / 1e15:.1f} PFLOP"
    if not plan.fp32_flops:
        return f"compute per GPU per step: {flops} (~{plan.compute_seconds:.1f} s at {at})"
    fp32 = "on bf16 tensor cores (--dsa-bf16)" if layout.dsa_bf16 else f"at {layout.fp32_tflops:g} TFLOPS"
    return (
        f"compute per GPU per step: {flops} + {plan.fp32_flops / 1e15:.1f} PFLOP fp32 (DSA indexer and "
        f"attention) (~{plan.compute_seconds:.1f} s at {at}, the fp32 part {fp32})"
    )
