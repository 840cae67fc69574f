"""The measurements of benchmarks/gpu_check.py, one function per section.

Each section takes a `Ctx` (device, sizes, its deadline) and returns a `Section`: flat metrics and
named checks (a check that cannot run here is recorded as skipped, with the reason). An exception
is recorded as the section's error by the runner in gpu_check.py.

Only `asyncrl.model` and `asyncrl.trainer.logprobs` are imported unconditionally: the inference
engine and the config need pydantic, which the GPU machine's image lacks unless wheels are carried
(docs/gpu-check.md). Without it the decode and exact sections fail with that import error and
the others still run.

Shape legend: N tokens, K contraction dim, O output dim, E experts, D model dim.
"""

from __future__ import annotations

import platform
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from asyncrl.model import ModelArgs, Transformer
from asyncrl.model.compute import cpu_upcast
from asyncrl.model.fp8 import fp8_linear, quantize_activation, quantize_weight
from asyncrl.model.moe import GroupedExperts, grouped_swiglu
from asyncrl.trainer.logprobs import chunked_logprobs

try:
    from asyncrl.config.inference import InferenceConfig
    from asyncrl.inference import Engine, SamplingOptions
    from asyncrl.model import from_pretrained
    from asyncrl.trainer.mismatch import MismatchSums, mismatch_sums, routing_agreement
    from asyncrl.trainer.packing import pack_samples
    from bench_mismatch import build_model_dir, generate

    ENGINE_IMPORT_ERROR: str | None = None
except ImportError as err:  # recorded in the env section; decode and exact report it as their error
    ENGINE_IMPORT_ERROR = f"{type(err).__name__}: {err}"

__all__ = [
    "ENGINE_IMPORT_ERROR",
    "Check",
    "Ctx",
    "Section",
    "Sizes",
    "build_random_model",
    "decode_section",
    "env_section",
    "exact_section",
    "fp8_section",
    "matmul_peak_section",
    "train_flops_per_token",
    "trainer_section",
]


@dataclass(frozen=True, kw_only=True)
class Sizes:
    """Problem sizes of one mode (full on a GPU, or --tiny)."""

    model_name: str
    model: ModelArgs  # the trainer and decode model
    dtype: torch.dtype  # of the peak, the trainer and decode (bf16 on the GPU; fp32 for --tiny on CPU)
    exact_preset: str  # exact mode runs a preset through the real load path
    peak_dim: int  # square matmul for the peak
    train_rows: int  # micro-batches per step, each one packed row
    train_seq_len: int
    train_sample_len: int  # sequences packed per row: seq_len / sample_len
    train_steps: int  # timed steps, after two warm-up steps
    fp8_check_shapes: tuple[tuple[int, int, int], ...]  # (N, K, O)
    fp8_speed_shapes: tuple[tuple[int, int, int], ...]
    fp8_iters: int
    decode_concurrency: tuple[int, ...]
    decode_prompt_len: int
    decode_new_tokens: int
    exact_prompts: int
    exact_new_tokens: int
    weights_model_name: str  # the model the weights section sends over an update channel
    weights_model: ModelArgs


@dataclass
class Ctx:
    device: torch.device
    sizes: Sizes
    seed: int
    deadline: float  # time.perf_counter() value by which the section should be done
    peak_flops: float | None = None  # set by the matmul_peak section, read by the trainer's MFU

    def time_left(self) -> float:
        return self.deadline - time.perf_counter()


@dataclass(frozen=True, kw_only=True)
class Check:
    """A correctness check: `passed` is None when it was skipped (then `skipped` says why)."""

    passed: bool | None
    value: float | None = None
    limit: float | None = None
    skipped: str | None = None
    note: str | None = None


@dataclass
class Section:
    metrics: dict[str, float | int | str | bool | None] = field(default_factory=dict)
    checks: dict[str, Check] = field(default_factory=dict)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_per_call(
    fn: Callable[[], object], ctx: Ctx, iters: int, share: float = 1.0, warmup: int = 2
) -> float:
    """Median seconds per call after `warmup` calls; stops early once `share` of the time left is spent."""
    for _ in range(warmup):
        fn()
    sync(ctx.device)
    stop = time.perf_counter() + share * max(ctx.time_left(), 0.0)
    times = []
    while len(times) < iters and (not times or time.perf_counter() < stop):
        start = time.perf_counter()
        fn()
        sync(ctx.device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.float()
    return float((got.float() - want).norm() / want.norm().clamp(min=1e-30))


def build_random_model(args: ModelArgs, device: torch.device, dtype: torch.dtype, seed: int) -> Transformer:
    """A model with the rules of `Transformer.init_weights` (N(0, 0.02) matrices, unit norms, zero
    biases), but drawn on `device`: init_weights draws on the CPU, which takes tens of seconds for
    the 6.6B parameters of the GPU model."""
    with torch.device(device):
        model = Transformer(args)
    model.to(dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model


# -- environment --------------------------------------------------------------------------------
def env_section(ctx: Ctx) -> Section:
    """What this run depends on: versions, the device, the optional torch APIs, the engine import."""
    dev = ctx.device
    cuda = dev.type == "cuda"
    return Section(
        metrics={
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name(dev) if cuda else platform.processor() or platform.machine(),
            "capability": ".".join(map(str, torch.cuda.get_device_capability(dev))) if cuda else None,
            "F.grouped_mm": hasattr(F, "grouped_mm"),
            "F.scaled_mm": hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"),
            "torch._scaled_mm": hasattr(torch, "_scaled_mm"),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "engine_imports": ENGINE_IMPORT_ERROR or "yes",
        }
    )


# -- matmul peak --------------------------------------------------------------------------------
def matmul_peak_section(ctx: Ctx) -> Section:
    """Achieved FLOP/s of a square matmul on random data: the MFU denominator of this run."""
    n, dtype = ctx.sizes.peak_dim, ctx.sizes.dtype
    gen = torch.Generator(device=ctx.device).manual_seed(ctx.seed)
    a = torch.randn(n, n, device=ctx.device, generator=gen).to(dtype)
    b = torch.randn(n, n, device=ctx.device, generator=gen).to(dtype)
    seconds = time_per_call(lambda: a @ b, ctx, iters=50, share=0.5, warmup=10)  # clocks ramp up
    ctx.peak_flops = 2.0 * n**3 / seconds
    return Section(
        metrics={"size": n, "dtype": str(dtype).removeprefix("torch."), "tflops": ctx.peak_flops / 1e12}
    )


# -- trainer ------------------------------------------------------------------------------------
def train_flops_per_token(args: ModelArgs, mean_context: float) -> float:
    """6 x active non-embedding parameters (LM head included) + causal attention, fwd + bwd.

    The same formula as `asyncrl.trainer.metrics.flops_per_token`, which this script cannot import
    without pydantic; tests/unit/benchmarks/test_gpu_check.py checks that the two agree.
    """
    dense = args.num_params(active=True) - args.vocab_size * args.hidden_size
    return 6.0 * dense + 12 * args.num_hidden_layers * args.num_attention_heads * args.head_dim * mean_context


def _train_rows(ctx: Ctx) -> list[tuple[torch.Tensor, ...]]:
    """Packed rows as the trainer sees them: [1, T] ids, positions restarting per sequence, targets."""
    s, gen = ctx.sizes, torch.Generator().manual_seed(ctx.seed)
    rows = []
    for _ in range(s.train_rows):
        ids_1T = torch.randint(0, s.model.vocab_size, (1, s.train_seq_len), generator=gen)
        pos_1T = torch.arange(s.train_sample_len).repeat(s.train_seq_len // s.train_sample_len)[None]
        target_T = ids_1T[0].roll(-1)
        temp_T = torch.ones(s.train_seq_len)
        rows.append(tuple(t.to(ctx.device) for t in (ids_1T, pos_1T, target_T, temp_T)))
    return rows


def _fwd_bwd(model: Transformer, rows: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
    """The trainer's forward (hidden states, then logprobs through the chunked LM head) and backward."""
    model.zero_grad(set_to_none=True)
    total = torch.zeros((), device=rows[0][0].device)
    for ids_1T, pos_1T, target_T, temp_T in rows:
        h_TD = model(ids_1T, pos_1T, compute_logits=False).hidden_states[0]
        logprobs_T, _ = chunked_logprobs(h_TD, model.lm_head.weight, target_T, temp_T, 1024)
        loss = -logprobs_T.mean() / len(rows)
        loss.backward()
        total += loss.detach()
    return total


def trainer_section(ctx: Ctx) -> Section:
    """Forward + backward of the MoE on packed rows; tokens/s and MFU against the measured peak."""
    s, out = ctx.sizes, Section()
    out.checks.update(_grouped_gemm_checks(ctx))
    model = build_random_model(s.model, ctx.device, s.dtype, ctx.seed).train()
    grouped = _uses_grouped_mm(ctx)
    if out.checks["grouped_mm_matches_loop"].passed is False:  # still measure, with the loop
        for module in model.modules():
            if isinstance(module, GroupedExperts):
                module.expert_linear = _loop_matmul
        grouped = False
    rows = _train_rows(ctx)
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    loss = _fwd_bwd(model, rows)  # warm-up
    grads_finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
    out.checks["loss_finite"] = Check(passed=bool(torch.isfinite(loss)), value=float(loss))
    out.checks["grads_finite"] = Check(passed=grads_finite)
    seconds = time_per_call(lambda: _fwd_bwd(model, rows), ctx, iters=s.train_steps, share=0.8, warmup=1)
    num_tokens = s.train_rows * s.train_seq_len
    mean_context = (s.train_sample_len + 1) / 2  # positions 0..L-1 attend to 1..L keys
    flops_per_token = train_flops_per_token(s.model, mean_context)
    achieved = flops_per_token * num_tokens / seconds
    cuda = ctx.device.type == "cuda"
    out.metrics.update(
        model=describe(s.model_name, s.model),
        dtype=str(s.dtype).removeprefix("torch."),
        grouped_gemm=grouped,
        tokens_per_step=num_tokens,
        rows=f"{s.train_rows} x {s.train_seq_len} tokens, sequences of {s.train_sample_len}",
        mean_context=mean_context,
        flops_per_token=flops_per_token,
        step_s=seconds,
        tokens_per_s=num_tokens / seconds,
        achieved_tflops=achieved / 1e12,
        mfu=None if ctx.peak_flops is None else achieved / ctx.peak_flops,
        peak_memory_gb=torch.cuda.max_memory_allocated(ctx.device) / 2**30 if cuda else None,
    )
    return out


def describe(name: str, args: ModelArgs) -> str:
    total, active = args.num_params() / 1e9, args.num_params(active=True) / 1e9
    return (
        f"{name}: {total:.2f}B params, {active:.2f}B active, {args.num_hidden_layers} layers, "
        f"d{args.hidden_size}, {args.num_experts} experts top-{args.num_experts_per_tok}"
    )


def _uses_grouped_mm(ctx: Ctx) -> bool:
    """The condition under which asyncrl.model.moe.grouped_swiglu takes F.grouped_mm in training:
    bf16 on CUDA, or on a CPU with native bf16 kernels."""
    if not hasattr(F, "grouped_mm") or ctx.sizes.dtype != torch.bfloat16:
        return False
    return ctx.device.type == "cuda" or not cpu_upcast(torch.empty(0, dtype=torch.bfloat16))


def _loop_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.T


def _grouped_gemm_checks(ctx: Ctx) -> dict[str, Check]:
    """grouped_mm SwiGLU == the per-expert loop (output and weight gradients); also with an empty expert."""
    if not _uses_grouped_mm(ctx):
        why = (
            "no CUDA device" if ctx.device.type != "cuda" else f"torch {torch.__version__} lacks F.grouped_mm"
        )
        skipped = Check(passed=None, skipped=f"{why}: the MoE runs the per-expert loop")
        return {"grouped_mm_matches_loop": skipped, "grouped_mm_empty_expert": skipped}
    return {
        "grouped_mm_matches_loop": _grouped_vs_loop(ctx, [125] * 8),
        "grouped_mm_empty_expert": _grouped_vs_loop(ctx, [300, 0, 100, 150, 50, 200, 120, 80]),
    }


def _grouped_vs_loop(ctx: Ctx, counts: list[int]) -> Check:
    E, D, hidden = len(counts), 512, 256
    gen = torch.Generator(device=ctx.device).manual_seed(ctx.seed)
    counts_E = torch.tensor(counts, device=ctx.device)
    x_ND = torch.randn(sum(counts), D, device=ctx.device, generator=gen).bfloat16()
    shapes = ((E, hidden, D), (E, hidden, D), (E, D, hidden))
    ws = [(torch.randn(shape, device=ctx.device, generator=gen) * 0.05).bfloat16() for shape in shapes]
    results = []
    for linear in (None, _loop_matmul):  # None: grouped_mm; a matmul hook forces the loop
        params = [w.clone().requires_grad_() for w in ws]
        try:
            y_ND = grouped_swiglu(x_ND, counts_E, *params, linear=linear)
            y_ND.float().square().sum().backward()
        except RuntimeError as err:  # the kernel refuses these operands on this torch / GPU
            return Check(passed=False, note=f"{type(err).__name__}: {err}"[:500])
        results.append((y_ND.detach(), [p.grad for p in params]))
    (fast, fast_grads), (loop, loop_grads) = results
    err = max([rel_error(fast, loop)] + [rel_error(a, b) for a, b in zip(fast_grads, loop_grads)])
    note = "max rel. error over the output and the 3 weight gradients"
    return Check(passed=err < 2e-2, value=err, limit=2e-2, note=note)


# -- FP8 ----------------------------------------------------------------------------------------
def _scaled_mm_unavailable(device: torch.device) -> str | None:
    """Why the blockwise FP8 kernel cannot run here, or None."""
    if device.type != "cuda":
        return "no CUDA device"
    cap = torch.cuda.get_device_capability(device)
    if cap < (9, 0):
        return f"compute capability {cap[0]}.{cap[1]} < 9.0"
    if not (hasattr(F, "scaled_mm") and hasattr(F, "ScalingType")):
        private = "has" if hasattr(torch, "_scaled_mm") else "lacks"
        return f"torch {torch.__version__} lacks F.scaled_mm / F.ScalingType (it {private} torch._scaled_mm)"
    recipes = ("BlockWise1x128", "BlockWise128x128")
    if not all(hasattr(F.ScalingType, r) for r in recipes):
        return f"torch {torch.__version__}: F.ScalingType lacks {' or '.join(recipes)}"
    return None


@torch.no_grad()
def fp8_section(ctx: Ctx) -> Section:
    """Block-scale FP8 (1x128 activations, 128x128 weights): error vs fp32, kernel vs emulation, speed
    vs bf16."""
    s, out = ctx.sizes, Section()
    gen = torch.Generator(device=ctx.device).manual_seed(ctx.seed)

    def operands(shape: tuple[int, int, int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        n, k, o = shape
        x_NK = torch.randn(n, k, device=ctx.device, generator=gen)
        w_OK = torch.randn(o, k, device=ctx.device, generator=gen) * 0.05
        return x_NK.to(dtype), w_OK.to(dtype)

    errs = []
    for shape in s.fp8_check_shapes:
        x, w = operands(shape, torch.float32)
        errs.append(rel_error(fp8_linear(x, w, backend="emulated"), x.double() @ w.double().T))
    # e4m3 keeps 3 mantissa bits: about 3.7% relative error on random data, on any device
    out.checks["emulated_vs_fp32"] = Check(passed=max(errs) < 0.05, value=max(errs), limit=0.05)
    why = _scaled_mm_unavailable(ctx.device)
    kernel = Check(passed=None, skipped=why) if why else _scaled_mm_check(s.fp8_check_shapes, operands)
    out.checks["scaled_mm_vs_emulated"] = kernel
    if kernel.passed is False:
        out.metrics["backend"] = "none: the scaled_mm kernel failed, speed not measured"
        return out
    backend = "emulated" if why else "scaled_mm"
    out.metrics["backend"] = backend
    for i, shape in enumerate(s.fp8_speed_shapes):
        share = 1.0 / (3 * (len(s.fp8_speed_shapes) - i))  # of the time left: 3 timings per shape
        out.metrics.update(_fp8_speed(*operands(shape, torch.bfloat16), backend, ctx, share))
    return out


def _fp8_speed(x_NK: torch.Tensor, w_OK: torch.Tensor, backend: str, ctx: Ctx, share: float) -> dict:
    """fp8_linear (quantize both operands, then the matmul) against bf16 F.linear on the same shape."""
    iters = ctx.sizes.fp8_iters
    t_bf16 = time_per_call(lambda: F.linear(x_NK, w_OK), ctx, iters, share)
    t_fp8 = time_per_call(lambda: fp8_linear(x_NK, w_OK, backend=backend), ctx, iters, share)
    t_quant = time_per_call(lambda: (quantize_activation(x_NK), quantize_weight(w_OK)), ctx, iters, share)
    (n, k), o = x_NK.shape, w_OK.shape[0]
    flop, key = 2.0 * n * k * o, f"{n}x{k}x{o}"
    return {
        f"{key} bf16_tflops": flop / t_bf16 / 1e12,
        f"{key} fp8_linear_tflops": flop / t_fp8 / 1e12,
        f"{key} quantize_ms": t_quant * 1e3,
        f"{key} fp8_linear_speedup_vs_bf16": t_bf16 / t_fp8,
        # fp8_linear minus the quantization timed alone: an estimate of the kernel's share
        f"{key} fp8_matmul_only_speedup_vs_bf16": t_bf16 / max(t_fp8 - t_quant, 1e-9),
    }


def _scaled_mm_check(shapes: tuple[tuple[int, int, int], ...], operands: Callable) -> Check:
    """fp8_linear through the kernel vs the emulation, on the same quantized operands."""
    errs = []
    for shape in shapes:
        x, w = operands(shape, torch.bfloat16)
        try:
            got = fp8_linear(x, w, backend="scaled_mm")
        except (RuntimeError, ValueError, TypeError, AttributeError) as err:  # API or layout not this torch's
            return Check(passed=False, note=f"scaled_mm raised on {list(shape)}: {type(err).__name__}: {err}")
        errs.append(rel_error(got, fp8_linear(x, w, backend="emulated")))
    # the kernel rounds its output to bf16 (~4e-3)
    return Check(passed=max(errs) < 1e-2, value=max(errs), limit=1e-2)


# -- engine decode ------------------------------------------------------------------------------
def _require_engine() -> None:
    if ENGINE_IMPORT_ERROR is not None:
        raise RuntimeError(
            f"the inference engine does not import here ({ENGINE_IMPORT_ERROR}); carry pydantic "
            f"wheels as docs/gpu-check.md says"
        )


def decode_section(ctx: Ctx) -> Section:
    """Engine decode tokens/s (temperature 1, in process) at each concurrency c."""
    _require_engine()
    s, out = ctx.sizes, Section()
    model = build_random_model(s.model, ctx.device, s.dtype, ctx.seed).eval().requires_grad_(False)
    _decode_run(model, ctx, concurrency=4, new_tokens=4, budget_s=ctx.time_left() / 4)  # warm-up
    for i, c in enumerate(s.decode_concurrency):
        share = ctx.time_left() / (len(s.decode_concurrency) - i)
        run = _decode_run(model, ctx, concurrency=c, new_tokens=s.decode_new_tokens, budget_s=share)
        out.metrics.update({f"c{c} {k}": v for k, v in run.items() if k != "all_tokens"})
        out.checks[f"c{c}_all_tokens_generated"] = (
            Check(passed=None, skipped="the run stopped at its time budget")
            if run["truncated"]
            else Check(passed=run["all_tokens"])
        )
        if run["decode_tok_s"] is None:
            raise RuntimeError(f"concurrency {c}: no step ran with all {c} sequences decoding")
    dtype = str(s.dtype).removeprefix("torch.")
    out.metrics["setting"] = (
        f"{s.model_name} {dtype}, prompts of {s.decode_prompt_len} random tokens, "
        f"{s.decode_new_tokens} new tokens each (EOS ignored), temperature 1"
    )
    return out


def _decode_run(model: Transformer, ctx: Ctx, concurrency: int, new_tokens: int, budget_s: float) -> dict:
    """Run `concurrency` requests to completion (or until `budget_s`).

    decode_tok_s counts the steady state only: the steps after every request has its first token
    (all prefills done) up to the step in which the first request finishes, so each of them
    decodes exactly `concurrency` sequences. e2e_tok_s is all generated tokens over the whole run.
    """
    s, c = ctx.sizes, concurrency
    length = s.decode_prompt_len + new_tokens
    cfg = InferenceConfig(
        model="in-memory",
        max_num_seqs=c,
        kv_cache_tokens=c * (length + 16),
        max_model_len=length,
        seed=ctx.seed,
    )
    engine = Engine(model, cfg)
    gen = torch.Generator().manual_seed(ctx.seed + c)
    opts = SamplingOptions(temperature=1.0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(c):
        engine.add_request(
            str(i), torch.randint(0, 256, (s.decode_prompt_len,), generator=gen).tolist(), opts
        )
    counts: dict[str, int] = {}
    start = time.perf_counter()
    window_start = window_end = None
    window_tokens = window_steps = 0
    truncated = False
    while engine.has_unfinished():
        outputs = engine.step()  # returns host lists: the step is complete on the device
        now = time.perf_counter()
        for o in outputs:
            counts[o.request_id] = counts.get(o.request_id, 0) + len(o.new_token_ids)
        if window_start is not None and window_end is None:
            window_tokens += sum(len(o.new_token_ids) for o in outputs)
            window_steps += 1
            if any(o.finish_reason is not None for o in outputs):
                window_end = now
        if window_start is None and len(counts) == c:
            window_start = now
        if now - start > budget_s:
            truncated = True
            break
    end = time.perf_counter()
    if window_start is not None and window_end is None:
        window_end = end
    steady = window_start is not None and window_steps > 0
    return {
        "decode_tok_s": window_tokens / (window_end - window_start) if steady else None,
        "decode_step_ms": 1e3 * (window_end - window_start) / window_steps if steady else None,
        "decode_steps": window_steps,
        "e2e_tok_s": sum(counts.values()) / (end - start),
        "truncated": truncated,
        "all_tokens": len(counts) == c and all(n == new_tokens for n in counts.values()),
    }


# -- exact mode ---------------------------------------------------------------------------------
@torch.no_grad()
def exact_section(ctx: Ctx) -> Section:
    """fp32 engine vs the trainer's fp32 recomputation on the device: logprobs must agree (mismatch
    KL ~ 0)."""
    _require_engine()
    s, out, dev = ctx.sizes, Section(), ctx.device
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model_dir(s.exact_preset, Path(tmp) / s.exact_preset, ctx.seed)
        num_seqs, max_len = s.exact_prompts, 64 + s.exact_new_tokens
        cfg = InferenceConfig(
            model=str(model_dir),
            dtype="float32",
            device=dev.type,
            kv_cache_tokens=num_seqs * max_len + 512,
            max_model_len=max_len,
            seed=ctx.seed,
        )
        engine = Engine.from_config(cfg)
        trainer_model = from_pretrained(str(model_dir), dtype=torch.float32, device=str(dev)).eval()
    gen = torch.Generator().manual_seed(ctx.seed)
    lengths = torch.randint(8, 48, (s.exact_prompts,), generator=gen).tolist()
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]
    samples = generate(engine, prompts, s.exact_new_tokens)
    total, max_abs, num_equal, agreement = MismatchSums(), 0.0, 0, 1.0
    for mb in pack_samples(samples, seq_len=2048, replay=True):
        mb = mb.to(dev)
        res = trainer_model(
            mb.input_ids,
            mb.position_ids,
            routed_experts=mb.routed_experts,
            return_routing=True,
            compute_logits=False,
        )
        lp_T, _ = chunked_logprobs(
            res.hidden_states[0], trainer_model.lm_head.weight, mb.target_ids, mb.temperatures, 512
        )
        total = total + mismatch_sums(lp_T, mb.inference_logprobs, mb.loss_mask)
        diff = (lp_T - mb.inference_logprobs)[mb.loss_mask].abs()
        max_abs, num_equal = max(max_abs, float(diff.max())), num_equal + int((diff == 0).sum())
        agree_L = routing_agreement(
            mb.routed_experts[0], res.router_topk[0], mb.loss_mask, trainer_model.args.moe_layers
        )
        agreement = min(agreement, float(agree_L.min()))
    m = total.metrics()
    expected = s.exact_prompts * s.exact_new_tokens
    out.checks["tokens_scored"] = Check(
        passed=total.num_tokens == expected, value=total.num_tokens, limit=expected
    )
    # the thresholds of tests/integration/mismatch/test_exact_mode.py (CPU measures ~1e-13)
    out.checks["mismatch_kl_mean"] = Check(passed=m["mismatch_kl"] < 1e-6, value=m["mismatch_kl"], limit=1e-6)
    out.checks["mismatch_kl_max"] = Check(
        passed=m["mismatch_kl_max"] < 1e-5, value=m["mismatch_kl_max"], limit=1e-5
    )
    out.metrics.update(
        setting=f"{s.exact_preset} fp32 (router and LM head x10), {s.exact_prompts} prompts x "
        f"{s.exact_new_tokens} tokens, temperature 1, R3 replay",
        max_abs_logprob_diff=max_abs,
        bitwise_equal_fraction=num_equal / max(total.num_tokens, 1),
        routing_agreement_min_layer=agreement,
        tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
    )
    return out
