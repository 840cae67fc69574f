"""Forward+backward throughput of asyncrl's MoE block and whole model against transformers' Qwen3-MoE.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_model.py \
        [--steps 3] [--bf16-steps N] [--no-write]

Both implementations get the same weights and inputs in one process, in fp32 and in bf16: the four
(implementation, dtype) runs of a row alternate round by round, each timed step right after an
untimed step of the same run (`report.time_interleaved`), and each gets the median of its steps
(--steps in fp32, --bf16-steps in bf16: by default as many on a CPU with native
bf16 kernels, 1 elsewhere, where transformers' bf16 runs torch's reference loops). The main shape is
the issue-17 one: a ~57M Qwen3-MoE (16 experts top-2, d512, 8 layers, ~13M active) on 4 x 512
tokens. The table prints tokens per second of process CPU time, the ratio ours / transformers, bf16
/ fp32 for each, and MFU against the matmul peak measured before each row in each dtype (best kept)
(through `asyncrl.model.compute`, the path our matmuls take; torch's plain bf16 matmul peak is
printed too, since it is what transformers gets), then where each step's time goes (torch.profiler,
by op). Results replace the "## Model (ISA)" section of BENCHMARKS.md for this CPU's ISA
(`asyncrl.model.compute.cpu_kernels()`): one section per kind of CPU.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from transformers import Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from asyncrl.model import Transformer, cpu_norm, cpu_scores, preset_args, to_hf_state_dict
from asyncrl.model.args import ModelArgs
from asyncrl.model.compute import blocked_attention, cpu_kernels, linear, set_cpu_blocked_attention
from asyncrl.model.moe import MoE
from asyncrl.trainer.metrics import flops_per_token
from report import time_interleaved, write_section

ROOT = Path(__file__).resolve().parents[1]


def _fwd_bwd(module, x, **kw):
    def run():
        module.zero_grad(set_to_none=True)
        out = module(x, **kw)
        out = out[0] if isinstance(out, tuple) else getattr(out, "logits", out)
        out.float().pow(2).mean().backward()

    return run


def hf_model_from_ours(ours: Transformer) -> Qwen3MoeForCausalLM:
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(**ours.args.to_hf_config())
    cfg._attn_implementation = "sdpa"
    hf = Qwen3MoeForCausalLM(cfg)
    hf_state = to_hf_state_dict(ours)
    # transformers 5 keeps experts fused in memory: build its layout from our stacked weights.
    for layer in range(ours.args.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        e = ours.layers[layer].mlp.experts
        hf_state = {k: v for k, v in hf_state.items() if not k.startswith(prefix + ".")}
        hf_state[f"{prefix}.gate_up_proj"] = torch.cat([e.gate_proj, e.up_proj], dim=1).detach()
        hf_state[f"{prefix}.down_proj"] = e.down_proj.detach()
    missing, unexpected = hf.load_state_dict(hf_state, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return hf


# The issue-17 shape: moe-50m's attention with 16 narrower experts (~57M parameters, ~13M active).
SHAPES: dict[str, ModelArgs] = {
    "tiny-moe": preset_args("tiny-moe"),
    "moe-57m-16e": dataclasses.replace(preset_args("moe-50m"), num_experts=16, moe_intermediate_size=256),
}


def bench_block(name: str, tokens: int, steps: dict[torch.dtype, int]) -> list[dict]:
    """MoE block rows, one per dtype in `steps` (dtype -> timed steps)."""
    args = SHAPES[name]
    ours = MoE(args)
    torch.nn.init.normal_(ours.gate.weight, std=0.5)
    for p in (ours.experts.gate_proj, ours.experts.up_proj, ours.experts.down_proj):
        torch.nn.init.normal_(p, std=0.02)
    from transformers import Qwen3MoeConfig

    hf = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(**args.to_hf_config()))
    with torch.no_grad():
        hf.gate.weight.copy_(ours.gate.weight)
        hf.experts.gate_up_proj.copy_(torch.cat([ours.experts.gate_proj, ours.experts.up_proj], 1))
        hf.experts.down_proj.copy_(ours.experts.down_proj)
    x = torch.randn(1, tokens, args.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(x).out_BTD - hf(x)).abs().max() < 1e-4
    flops = 6 * 3 * args.hidden_size * args.moe_intermediate_size * args.num_experts_per_tok
    return _rows(f"MoE block ({name})", tokens, flops, ours, hf, x, steps)


def _rows(
    what: str, tokens: int, flops: float, ours: nn.Module, hf: nn.Module, x: torch.Tensor, steps: dict
) -> list[dict]:
    """Time fwd+bwd of copies of `ours` and `hf` in each dtype of `steps`, all interleaved; where our
    bf16 attention takes the blocked matmuls (`asyncrl.model.compute.blocked_attention`), ours with
    torch's flash kernel instead too (the row's "ours_flash") and with the blocked attention's scores
    from fp32 matmuls instead of the score kernel ("ours_fp32_scores", where that kernel runs), and
    where the RMSNorm kernel loads, ours in bf16 with torch's RMSNorm ops instead
    ("ours_torch_norm")."""
    runs: list[tuple[Callable[[], None], int]] = []
    first: dict[torch.dtype, int] = {}  # dtype -> index of its (ours, hf) runs
    flash: dict[torch.dtype, int] = {}  # dtype -> index of ours with the flash kernel
    torch_norm: dict[torch.dtype, int] = {}  # dtype -> index of ours with torch's RMSNorm ops
    fp32_scores: dict[torch.dtype, int] = {}  # dtype -> index of ours with fp32 score matmuls
    for dtype in steps:
        x_d = x.to(dtype) if x.is_floating_point() else x
        first[dtype] = len(runs)
        for module in (ours, hf):
            runs.append((_fwd_bwd(copy.deepcopy(module).to(dtype), x_d), steps[dtype]))
        if dtype == torch.bfloat16 and isinstance(ours, Transformer) and _blocked_attention_rule():
            flash[dtype] = len(runs)
            runs.append((_with_flash(_fwd_bwd(copy.deepcopy(ours).to(dtype), x_d)), steps[dtype]))
        if dtype == torch.bfloat16 and isinstance(ours, Transformer) and cpu_norm.load()[0] is not None:
            torch_norm[dtype] = len(runs)
            runs.append((_with_torch_norm(_fwd_bwd(copy.deepcopy(ours).to(dtype), x_d)), steps[dtype]))
        if dtype in flash and cpu_scores.available():
            fp32_scores[dtype] = len(runs)
            runs.append((_with_fp32_scores(_fwd_bwd(copy.deepcopy(ours).to(dtype), x_d)), steps[dtype]))
    times = time_interleaved(runs)
    rows = []
    for dtype, i in first.items():
        rows.append(_row(what, dtype, tokens, times[i], times[i + 1], flops))
        if dtype in flash:
            rows[-1]["ours_flash"] = tokens / times[flash[dtype]]
        if dtype in torch_norm:
            rows[-1]["ours_torch_norm"] = tokens / times[torch_norm[dtype]]
        if dtype in fp32_scores:
            rows[-1]["ours_fp32_scores"] = tokens / times[fp32_scores[dtype]]
    return rows


def _blocked_attention_rule() -> bool:
    """Whether bf16 training attention takes the blocked matmuls on this CPU."""
    q = torch.zeros(1, 2, 8, 4, dtype=torch.bfloat16, requires_grad=True)
    return blocked_attention(q, q, q, {"is_causal": True})


def _with_flash(run: Callable[[], None]) -> Callable[[], None]:
    def flash() -> None:
        set_cpu_blocked_attention(False)
        try:
            run()
        finally:
            set_cpu_blocked_attention(None)

    return flash


def _with_torch_norm(run: Callable[[], None]) -> Callable[[], None]:
    return _without(cpu_norm, run)


def _with_fp32_scores(run: Callable[[], None]) -> Callable[[], None]:
    return _without(cpu_scores, run)


def _without(kernel_module, run: Callable[[], None]) -> Callable[[], None]:
    """`run` with the C kernel of `kernel_module` (cpu_norm, cpu_scores) turned off."""

    def without() -> None:
        kernel_module.set_enabled(False)
        try:
            run()
        finally:
            kernel_module.set_enabled(True)

    return without


def paired_models(
    args: ModelArgs, to_hf, batch: int, seq: int
) -> tuple[Transformer, torch.nn.Module, torch.Tensor]:
    """Our model over `args` (routers spread), transformers' copy `to_hf(ours)`, and input ids on
    which both give the same logits (checked)."""
    ours = Transformer(args)
    ours.init_weights(seed=0)
    with torch.no_grad():
        for layer in ours.layers:
            if layer.is_moe:
                layer.mlp.gate.weight.normal_(std=0.5)  # spread tokens over experts
    hf = to_hf(ours)
    ids = torch.randint(0, ours.args.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(ids).logits - hf(ids).logits).abs().max() < 1e-3
    return ours, hf, ids


def bench_model(name: str, batch: int, seq: int, steps: dict[torch.dtype, int]) -> list[dict]:
    """Whole-model rows, one per dtype in `steps` (dtype -> timed steps)."""
    ours, hf, ids = paired_models(SHAPES[name], hf_model_from_ours, batch, seq)
    flops = flops_per_token(ours.args, mean_context=(seq + 1) / 2)
    return _rows(f"whole model ({name})", batch * seq, flops, ours, hf, ids, steps)


MATMUL_OPS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::_grouped_mm")


def profile_shares(name: str, batch: int, seq: int, dtype: torch.dtype) -> dict[str, dict[str, float]]:
    """Share of a fwd+bwd's self CPU time by op family, for asyncrl and for transformers (the two
    alternate; the least time per op over 3 profiled steps, so that a busy moment counts less)."""
    from torch.profiler import ProfilerActivity, profile

    ours, hf, ids = paired_models(SHAPES[name], hf_model_from_ours, batch, seq)
    runs = {"asyncrl": _fwd_bwd(ours.to(dtype), ids), "transformers": _fwd_bwd(hf.to(dtype), ids)}
    best: dict[str, dict[tuple[str, str], float]] = {who: {} for who in runs}
    for _ in range(3):
        for who, run in runs.items():
            run()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                run()
            per_op: dict[tuple[str, str], float] = {}
            for e in prof.events():
                key = (_family(e), e.name)
                per_op[key] = per_op.get(key, 0.0) + e.self_cpu_time_total
            for key, us in per_op.items():
                best[who][key] = min(best[who].get(key, float("inf")), us)
    shares = {}
    for who, self_us in best.items():
        total = sum(self_us.values())
        fam = {f: sum(v for (g, _), v in self_us.items() if g == f) / total for f in ("matmul", "attention")}
        shares[who] = fam | {"other": 1 - fam["matmul"] - fam["attention"]}
    return shares


def _family(event) -> str:
    """ "attention" for torch's attention kernels and everything under the blocked attention's
    forward or backward (its matmuls included), "matmul" for the other matmuls, else "other"."""
    e = event
    while e is not None:
        if "scaled_dot_product" in e.name or e.name in ("_Blocked", "_BlockedBackward"):
            return "attention"
        e = e.cpu_parent
    return "matmul" if event.name in MATMUL_OPS else "other"


def _row(
    what: str, dtype: torch.dtype, tokens: int, t_ours: float, t_hf: float, flops_per_tok: float
) -> dict:
    return {
        "what": what,
        "dtype": dtype,
        "tokens": tokens,
        "ours": tokens / t_ours,
        "hf": tokens / t_hf,
        "flops_per_tok": flops_per_tok,
    }


def _matmul_peak(dtype: torch.dtype, plain: bool = False, size: int = 1024, seconds: float = 0.5) -> float:
    """FLOP/s of a size^3 matmul per CPU second: through `asyncrl.model.compute.linear` (the path our
    matmuls take: fp32 on bf16 values where the CPU has no bf16 kernels), or torch's plain matmul
    (`plain`: what transformers gets)."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    matmul = (lambda: a @ b.T) if plain else (lambda: linear(a, b))
    matmul()
    iters, start = 0, time.process_time()
    while iters < 2 or time.process_time() - start < seconds:
        matmul()
        iters += 1
    return 2.0 * size**3 * iters / (time.process_time() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3, help="timed fp32 steps (after a warm-up)")
    p.add_argument(
        "--bf16-steps",
        type=int,
        default=None,
        help="timed bf16 steps (default: --steps on a CPU with native bf16, else 1: transformers' bf16 "
        "runs reference loops there)",
    )
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args()
    kernels = cpu_kernels()
    if a.bf16_steps is None:
        a.bf16_steps = a.steps if kernels.native_bf16 else 1
    torch.manual_seed(0)
    fp32, bf16 = torch.float32, torch.bfloat16
    steps = {fp32: a.steps, bf16: a.bf16_steps}
    # The peak is re-measured before each row and the best kept: one short measurement on a shared
    # machine can land in a busy moment and inflate MFU.
    peaks, native_bf16 = {fp32: 0.0, bf16: 0.0}, 0.0
    rows = []
    for bench, args in (
        (bench_block, ("moe-57m-16e", 4096, steps)),
        (bench_model, ("tiny-moe", 8, 512, steps)),
        (bench_model, ("moe-57m-16e", 4, 512, steps)),
    ):
        peaks = {d: max(p, _matmul_peak(d)) for d, p in peaks.items()}
        native_bf16 = max(native_bf16, _matmul_peak(bf16, plain=True, seconds=0.1))
        rows += bench(*args)
        print(*rows[-2:], sep="\n", flush=True)
    shares = {dtype: profile_shares("moe-57m-16e", 4, 512, dtype) for dtype in (fp32, bf16)}
    table = "\n".join(
        _results_table(rows, peaks)
        + _profile_table(shares)
        + _summary(rows, shares, peaks, native_bf16)
        + ["", READING]
    )
    print(table)
    if not a.no_write:
        title = f"## Model ({kernels.isa})"
        write_section(title, f"{title}\n\n{_header(a, kernels)}\n\n{table}\n")


def _results_table(rows: list[dict], peaks: dict[torch.dtype, float]) -> list[str]:
    lines = [
        "| benchmark | dtype | tokens/step | asyncrl tok/s | transformers tok/s | ours / transformers "
        "| asyncrl MFU | transformers MFU |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        peak = peaks[r["dtype"]]
        mfu_ours, mfu_hf = (r[k] * r["flops_per_tok"] / peak for k in ("ours", "hf"))
        lines.append(
            f"| {r['what']} | {_name(r['dtype'])} | {r['tokens']} | {r['ours']:.0f} | {r['hf']:.0f} | "
            f"{r['ours'] / r['hf']:.2f}x | {mfu_ours:.1%} | {mfu_hf:.1%} |"
        )
    return lines


def _profile_table(shares: dict[torch.dtype, dict[str, dict[str, float]]]) -> list[str]:
    args57 = SHAPES["moe-57m-16e"]
    attn_flops = _attention_flops(args57, 256.5)
    return [
        "",
        "Where a fwd+bwd of the moe-57m-16e model spends its time (torch.profiler, self CPU time, the "
        "least per op over 3 profiled steps):",
        "",
        "| | dtype | matmul (mm, grouped_mm) | attention (fwd+bwd) | everything else |",
        "|---|---|---|---|---|",
        *(
            f"| {who} | {_name(dtype)} | {v['matmul']:.0%} | {v['attention']:.0%} | {v['other']:.0%} |"
            for dtype, by_who in shares.items()
            for who, v in by_who.items()
        ),
        "",
        f"Causal attention is {attn_flops / flops_per_token(args57, 256.5):.0%} of this model's FLOPs at 512 "
        "tokens per row (asyncrl.trainer.metrics.flops_per_token).",
    ]


def _summary(
    rows: list[dict], shares: dict, peaks: dict[torch.dtype, float], native_bf16: float
) -> list[str]:
    """bf16 / fp32 and the issue-30 goals on the moe-57m-16e model, and how far a perfect matmul
    would take asyncrl's bf16 step: every matmul FLOP at the measured bf16 peak, the rest of the
    timed step (its profiled share) unchanged."""
    f32, b16 = (
        next(r for r in rows if r["what"] == "whole model (moe-57m-16e)" and r["dtype"] == dtype)
        for dtype in (torch.float32, torch.bfloat16)
    )
    vs_hf, vs_fp32, hf_bf16_fp32 = b16["ours"] / b16["hf"], b16["ours"] / f32["ours"], b16["hf"] / f32["hf"]
    args57 = SHAPES["moe-57m-16e"]
    matmul_flops = flops_per_token(args57, 256.5) - _attention_flops(args57, 256.5)
    step, matmul_share = b16["tokens"] / b16["ours"], shares[torch.bfloat16]["asyncrl"]["matmul"]
    ideal = step * (1 - matmul_share) + b16["tokens"] * matmul_flops / peaks[torch.bfloat16]
    return [
        "",
        f"bf16 / fp32 on the moe-57m-16e model: asyncrl {vs_fp32:.2f}x, transformers {hf_bf16_fp32:.2f}x. "
        f"Goals: asyncrl bf16 >= 1.3x transformers bf16 {_holds(vs_hf >= 1.3)} ({vs_hf:.2f}x); "
        f"asyncrl bf16 >= asyncrl fp32 {_holds(vs_fp32 >= 1.0)} ({vs_fp32:.2f}x).",
        f"asyncrl's bf16 step takes {step:.2f} s, {step * matmul_share:.2f} s of it in matmuls (profiled "
        f"share). With every matmul FLOP at the bf16 peak below and the rest unchanged it would take "
        f"{ideal:.2f} s: {b16['tokens'] / b16['hf'] / ideal:.2f}x transformers.",
        *_variant_lines(b16),
        f"Matmul peak per CPU second (best of 3 in this run, 1024^2, through asyncrl.model.compute): "
        f"fp32 {peaks[torch.float32] / 1e9:.1f} GFLOP/s, bf16 {peaks[torch.bfloat16] / 1e9:.1f} GFLOP/s; "
        f"torch's plain bf16 matmul: {native_bf16 / 1e9:.2f} GFLOP/s.",
    ]


# The variants of ours timed beside the bf16 row: (row key, what replaced what, the module of the
# replaced kernel or "", what the default gains).
VARIANTS = (
    ("ours_flash", "torch's flash kernel instead of the blocked attention", "", "the blocked attention"),
    (
        "ours_torch_norm",
        "torch's ops for RMSNorm instead of the C kernel",
        "asyncrl.model.cpu_norm",
        "the kernel",
    ),
    (
        "ours_fp32_scores",
        "the blocked attention's scores and dP from fp32 matmuls instead of the C kernel",
        "asyncrl.model.cpu_scores",
        "the kernel",
    ),
)


def _variant_lines(b16: dict) -> list[str]:
    """One line per variant timed beside the bf16 row: its rate and how much faster the default is."""
    lines = []
    for key, instead, module, default in VARIANTS:
        if key in b16:
            where = f"{module}; " if module else ""
            lines.append(
                f"asyncrl's bf16 step with {instead} ({where}timed in the same interleaving): "
                f"{b16[key]:.0f} tok/s, {b16[key] / b16['hf']:.2f}x transformers; {default} makes the "
                f"step {b16['ours'] / b16[key]:.2f}x faster."
            )
    return lines


def _attention_flops(args: ModelArgs, mean_context: float) -> float:
    """Causal attention's share of `flops_per_token` (its 12 * layers * heads * head_dim * context)."""
    return 12 * args.num_hidden_layers * args.num_attention_heads * args.head_dim * mean_context


def _holds(ok: bool) -> str:
    return "holds" if ok else "does not hold"


def _header(a: argparse.Namespace, kernels) -> str:
    return (
        f"Forward+backward, same weights and inputs, one run: asyncrl and transformers in fp32 and in "
        f"bf16 alternate round by round, each timed step right after an untimed one of the same run "
        f"(median of {a.steps} fp32 / {a.bf16_steps} bf16 timed steps). Times and peaks are process "
        f"CPU time, which other jobs on a shared machine move "
        f"far less than wall time (they still share caches and memory bandwidth).\n"
        f"Machine: {_cpu_model()}, {torch.get_num_threads()} thread(s) (OMP_NUM_THREADS="
        f"{os.environ.get('OMP_NUM_THREADS', 'unset')}); torch CPU capability {kernels.isa}, oneDNN bf16 "
        f"kernels: {'yes' if kernels.native_bf16 else 'no'}; CPU flags: {_cpu_flags()}; "
        f"torch {torch.__version__}; shared with other jobs.\n"
        f"Command: `OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_model.py --steps {a.steps} "
        f"--bf16-steps {a.bf16_steps}`"
    )


def _cpuinfo(key: str) -> str:
    """The first /proc/cpuinfo value of `key` ("" where there is none)."""
    path = Path("/proc/cpuinfo")
    lines = path.read_text().splitlines() if path.exists() else []
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.split(":")[0].strip() == key), "")


def _cpu_model() -> str:
    return _cpuinfo("model name") or platform.machine()


def _cpu_flags() -> str:
    """The matmul-relevant flags of /proc/cpuinfo, each marked present or absent."""
    flags = set(_cpuinfo("flags").split())
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
    return " ".join(f"{f}{'' if f in flags else ' (no)'}" for f in wanted) if flags else "unknown"


READING = """\
Reading: in fp32 both implementations spend most of a step in the same kernels, oneDNN/MKL
matmuls and torch's CPU flash attention (profile table), so removing Python and copy overhead
brings asyncrl to parity or a little past it, not further. In bf16 on a CPU with AVX-512 BF16 and
no AMX, torch's flash kernel runs no faster than in fp32 while bf16 matmuls run ~2x faster:
asyncrl's training attention there comes from bf16 batched matmuls over blocks of queries (scores
in fp32, from a C kernel at the bf16 rate; docs/trainer.md, "bf16 on CPU"), which is where much of
its bf16 lead over transformers comes from (the steps timed with the flash kernel, and with fp32
score matmuls, instead show it). Its RMSNorm forward and backward are one C pass each
(asyncrl.model.cpu_norm) where torch runs a dozen elementwise ops, bf16 ones among the slowest
(the step timed with torch's ops instead shows the difference; in fp32 the two are closer). The
bf16 rows depend on the CPU: without AVX-512 BF16 / AMX, torch's bf16 matmul is a reference loop
(its peak is printed above), which transformers runs into; asyncrl computes bf16 matmuls,
attention and experts in fp32 on bf16 values there, so its bf16 runs at about its fp32 speed less
the casts. With AMX both use torch's own kernels (attention included), the MoE experts through
torch's grouped GEMM."""


def _name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]


if __name__ == "__main__":
    main()
