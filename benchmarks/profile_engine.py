"""Where an embedded-engine decode step spends its time, at a given concurrency, per model and dtype.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/profile_engine.py [--presets tiny-moe,moe-50m]

For each preset and dtype: `--concurrency` requests (token-id prompts of 16-64 tokens, greedy, EOS
ignored) are prefilled and decode `--warm-tokens` tokens (the middle of a 128-token answer), then
`--steps` pure decode steps are timed, split by phase:

- schedule: `Scheduler.schedule`;
- inputs: from the schedule to the model call (token/position tensors, KV slots, attention metadata,
  the dense decode rows' plan with their growth and compaction copies);
- forward: the model call, split into attention (paged attention incl. KV writes), MoE experts,
  router, and the rest (embedding, norms, q/k/v/o projections, RoPE, dense MLPs);
- lm_head, sampling (the sampler call), and commit + outputs (scheduler commit, stop checks,
  `RequestOutput`s): the rest of `Engine.step`.

Times are CPU time of the engine's thread (`time.thread_time`, torch on one thread), so that other
jobs on a shared machine inflate them little; the tokens/s printed is concurrency / CPU time per
step. A second pass runs `torch.profiler` over a few decode steps and lists the top aten and oneDNN
ops (`mkldnn::`, the packed-weight matmuls) of the model forward by self CPU time. HTTP and JSON are
not in these numbers: `bench_backends.py` gives the server's tokens/s to set against the
engine-only tokens/s printed here.

The phases are found by wrapping names both today's engine and older ones have (`Engine.step`,
`Scheduler.schedule`, the model and lm_head modules, `engine.sample`, `PagedAttention.__call__`,
`GroupedExperts.forward`, `Router.forward`), so the same script profiles an older checkout run
with its own PYTHONPATH. With --markdown it also prints the rows of BENCHMARKS.md's table.

`--compare-packing` times instead the decode step with packed weights (the default,
docs/inference.md, Performance, "Packed weights") against the same engine with packing turned off
(`asyncrl.model.compute.set_cpu_packing(False)`), alternating in windows of `--window` steps over
`--rounds` rounds on one engine (off first in even rounds, on first in odd ones), so both see the
same contexts and the same machine; it prints the median step time of each (CPU time of the
engine's thread with one torch thread, wall time with more) and their ratio. On tiny-moe, whose
weights are all below the packing size, both modes run the same code: its ratio shows the noise.

`--batch-sweep 1,4,16,64` times instead the decode step at each of these concurrencies (one engine
per size, the same prompts and warm-up; median of `--steps` steps, CPU time of the engine's thread
with one torch thread, wall time with more) and prints the step time against the batch. From that
curve it models the bench's two workloads (`bench_backends.py`: at most `--concurrency` requests in
flight, each decoding a fixed 128 or a uniform 16-256 tokens, for 128 and 256 requests): tokens
per second when every step costs what the curve says for the sequences in it (prefill, HTTP and
the contexts' growth left out). With mixed lengths the last requests run in ever smaller batches;
the modeled mixed / fixed ratio says what that tail costs on this curve.

`--compare-matmul-kernel` does the same for the CPU matmul kernels (`asyncrl.inference.cpu_matmul`:
the MoE routers and experts and the linears of few rows, the default on CPUs with AVX-512) against
torch's ops (oneDNN's packed weights for the matmuls), on the same engine; like the decode kernel
they run on torch's OpenMP threads.

`--compare-router-kernel` does the same for the routers alone: `cpu_matmul`'s router kernel (the
logits, softmax, top-k and normalisation of a layer's routing in one call) against torch's ops,
the experts and linears on their kernels in both modes.

`--compare-norm-kernel` does the same for the CPU RMSNorm kernel (`asyncrl.model.cpu_norm`, the
default wherever it builds) against torch's fused norm and the multiply by the weight.

`--compare-linear-rows N` does the same for the linear kernel's row limit: linears of up to
`cpu_matmul.MAX_LINEAR_ROWS` rows (the default) through the kernel, against up to N rows (e.g. 16,
the limit before it was raised), larger ones through oneDNN's packed matmuls.

`--compare-dtypes` times instead bf16 against fp32: one engine of each dtype over the same model,
prompts and warm-up, their decode steps alternating in windows as above (fp32 first in even rounds,
bf16 first in odd ones); it prints each one's median step time and bf16's speed-up over fp32
(`--dtypes` is ignored).

`--prefill-prompts K` (with the `--compare-*` modes): before every step, K new requests (prompts
of 16-64 tokens, one answer token each) join, so each timed step prefills them beside the
`--concurrency` decoding sequences, as a served engine's steps do while requests arrive (a prefill
chunk of K x 40 rows on average, where pure decode steps have `--concurrency` rows).

`--compare-decode-kernel` does the same for the CPU decode attention kernel
(`asyncrl.inference.cpu_decode`, the default) against SDPA over the same dense rows. The kernel
runs on torch's own OpenMP threads, so the clocks are the same as for packing: with one torch
thread all of it is the engine thread's CPU time, with more the wall time counts.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import functools
import itertools
import math
import os
import platform
import random
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

import asyncrl.inference.engine as engine_mod
from asyncrl.config.inference import InferenceConfig
from asyncrl.inference import Engine, SamplingOptions, cpu_matmul
from asyncrl.inference.kv_cache import PagedAttention
from asyncrl.model import compute, cpu_norm, from_pretrained, torch_dtype
from asyncrl.model.moe import GroupedExperts, Router
from asyncrl.tools.init_model import init_model

PHASES = (
    "schedule",
    "inputs",
    "attention",
    "experts",
    "router",
    "forward other",
    "lm_head",
    "sampling",
    "commit + outputs",
)


class Clock:
    """Accumulated seconds per phase, from wrapped callables (nested phases are subtracted)."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.marks: dict[str, float] = {}
        self.on = False

    def wrap(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            t0 = time.thread_time()
            self.marks[f"{name}:start"] = t0
            try:
                return fn(*args, **kwargs)
            finally:
                t1 = time.thread_time()
                self.marks[f"{name}:end"] = t1
                self.total[name] += t1 - t0

        return timed


@contextlib.contextmanager
def patched(obj, name: str, value) -> Iterator[None]:
    old = obj.__dict__.get(name, None) if isinstance(obj, type) else getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if old is None and isinstance(obj, type):
            delattr(obj, name)
        else:
            setattr(obj, name, old)


def build_engine(model_dir: Path, dtype: str, concurrency: int) -> Engine:
    cfg = InferenceConfig(
        model=str(model_dir), max_num_seqs=concurrency, device="cpu", kv_cache_tokens=65536, dtype=dtype
    )
    return Engine(from_pretrained(model_dir, dtype=torch_dtype(dtype)), cfg)


def start_decoding(engine: Engine, concurrency: int, max_tokens: int, warm_tokens: int) -> None:
    """Add `concurrency` requests, step until every one is past its prefill, then `warm_tokens` more."""
    g = torch.Generator().manual_seed(0)
    for i in range(concurrency):
        plen = int(torch.randint(16, 65, (1,), generator=g))
        prompt = torch.randint(0, 256, (plen,), generator=g).tolist()
        engine.add_request(
            str(i), prompt, SamplingOptions(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        )
    while any(
        r.num_computed_tokens < r.num_tokens - 1 or not r.output_token_ids for r in engine.requests.values()
    ):
        engine.step()
    for _ in range(warm_tokens):  # the context grows as in a served request (decode cost grows with it)
        engine.step()


def _batch(args: argparse.Namespace) -> str:
    """The timed steps' batch: the decoding sequences, and the prompts joining each step."""
    joined = f" + {args.prefill_prompts} prompts per step" if args.prefill_prompts else ""
    return f"c={args.concurrency}{joined}"


def joining(engine: Engine, prompts: int) -> Callable[[], object]:
    """`engine.step`, where each call first adds `prompts` new requests (token-id prompts of 16-64
    tokens, one answer token each): every step then prefills them beside the decoding sequences,
    as a served engine's steps do while requests arrive. The same prompts, in the same order, for
    every engine built over one model."""
    if not prompts:
        return engine.step
    g, count = torch.Generator().manual_seed(1), itertools.count()

    def step() -> object:
        for _ in range(prompts):
            plen = int(torch.randint(16, 65, (1,), generator=g))
            prompt = torch.randint(0, 256, (plen,), generator=g).tolist()
            options = SamplingOptions(temperature=0.0, max_tokens=1, ignore_eos=True)
            engine.add_request(f"joining-{next(count)}", prompt, options)
        return engine.step()

    return step


def phase_times(engine: Engine, steps: int) -> dict[str, float]:
    """Milliseconds per decode step in each phase, and the step's total."""
    clock = Clock()
    step = clock.wrap("step", engine.step)
    model = engine.model
    with contextlib.ExitStack() as stack:
        stack.enter_context(
            patched(engine.scheduler, "schedule", clock.wrap("schedule", engine.scheduler.schedule))
        )
        stack.enter_context(patched(model, "forward", clock.wrap("forward", model.forward)))
        stack.enter_context(patched(model.lm_head, "forward", clock.wrap("lm_head", model.lm_head.forward)))
        stack.enter_context(patched(engine_mod, "sample", clock.wrap("sampling", engine_mod.sample)))
        stack.enter_context(
            patched(PagedAttention, "__call__", clock.wrap("attention", PagedAttention.__call__))
        )
        stack.enter_context(patched(GroupedExperts, "forward", clock.wrap("experts", GroupedExperts.forward)))
        stack.enter_context(patched(Router, "forward", clock.wrap("router", Router.forward)))
        inputs = 0.0
        clock.on = True
        for _ in range(steps):
            step()
            inputs += clock.marks["forward:start"] - clock.marks["schedule:end"]
        clock.on = False
    t = clock.total
    ms = {
        "schedule": t["schedule"],
        "inputs": inputs,
        "attention": t["attention"],
        "experts": t["experts"],
        "router": t["router"],
        "forward other": t["forward"] - t["attention"] - t["experts"] - t["router"],
        "lm_head": t["lm_head"],
        "sampling": t["sampling"],
    }
    ms["commit + outputs"] = t["step"] - t["schedule"] - inputs - t["forward"] - t["lm_head"] - ms["sampling"]
    ms["step"] = t["step"]
    return {k: 1000 * v / steps for k, v in ms.items()}


def forward_ops(engine: Engine, steps: int, top: int) -> list[tuple[str, float]]:
    """(aten or mkldnn op, share of the profiled steps' self CPU time), the `top` largest."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    events = [e for e in prof.key_averages() if e.key.startswith(("aten::", "mkldnn::"))]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    return [(e.key, e.self_cpu_time_total / total) for e in events[:top]]


def profile(model_dir: Path, dtype: str, args: argparse.Namespace) -> tuple[dict[str, float], list]:
    engine = build_engine(model_dir, dtype, args.concurrency)
    max_tokens = args.warm_tokens + args.steps + args.profile_steps + 8
    start_decoding(engine, args.concurrency, max_tokens, args.warm_tokens)
    ms = phase_times(engine, args.steps)
    ops = forward_ops(engine, args.profile_steps, args.top_ops)
    return ms, ops


def compare(model_dir: Path, dtype: str, what: str, args: argparse.Namespace) -> dict[str, float]:
    """Median ms per decode step with `what` ("packing", "decode kernel", "matmul kernel", "router
    kernel", "norm kernel" or "linear rows") off and on, and off / on."""
    engine = build_engine(model_dir, dtype, args.concurrency + args.prefill_prompts)
    max_tokens = args.warm_tokens + 2 * args.rounds * (args.window + 1) + 8
    start_decoding(engine, args.concurrency, max_tokens, args.warm_tokens)
    step = joining(engine, args.prefill_prompts)
    kernel = engine.decode_kernel
    if what == "decode kernel" and kernel is None:
        raise SystemExit(f"no decode kernel to compare: {engine.decode_attention_note}")
    hooked = [m for m in engine.model.modules() if isinstance(m, GroupedExperts | compute.Linear | Router)]
    matmul_kernels = {m: getattr(m, "cpu_kernel", None) for m in hooked}  # older routers have none
    if what == "matmul kernel" and not any(matmul_kernels.values()):
        raise SystemExit(f"no matmul kernel to compare: {engine.matmul_kernel_note}")
    router_kernels = {m: k for m, k in matmul_kernels.items() if isinstance(m, Router)}
    if what == "router kernel" and not any(router_kernels.values()):
        raise SystemExit(f"no router kernel to compare: {engine.matmul_kernel_note}")
    if what == "norm kernel" and cpu_norm.load()[0] is None:
        raise SystemExit(f"no RMSNorm kernel to compare: {cpu_norm.note()}")
    linear_kernels = [k for k in matmul_kernels.values() if isinstance(k, cpu_matmul.LinearKernel)]
    if what == "linear rows" and not linear_kernels:
        raise SystemExit(f"no linear kernel to compare: {engine.matmul_kernel_note}")
    row_limit = cpu_matmul.MAX_LINEAR_ROWS

    def switch(on: bool) -> None:
        if what == "packing":
            compute.set_cpu_packing(None if on else False)  # on: the default rule
        elif what == "decode kernel":
            engine.decode_kernel = kernel if on else None
        elif what == "norm kernel":
            cpu_norm.set_enabled(on)
        elif what == "linear rows":
            cpu_matmul.MAX_LINEAR_ROWS = row_limit if on else args.compare_linear_rows
        elif what == "router kernel":
            for module, kernel_of in router_kernels.items():
                module.cpu_kernel = kernel_of if on else None
        else:
            for module, kernel_of in matmul_kernels.items():
                module.cpu_kernel = kernel_of if on else None

    def enter(mode: str) -> Callable[[], object]:
        switch(mode == "on")
        return step

    try:
        med = alternating_windows(("off", "on"), enter, args)
    finally:
        switch(True)
    return med | {"ratio": med["off"] / med["on"]}


def alternating_windows(
    modes: tuple[str, ...], enter: Callable[[str], Callable[[], object]], args: argparse.Namespace
) -> dict[str, float]:
    """Median ms per decode step of each mode: `args.rounds` rounds, each a window of `args.window`
    steps per mode, the modes' order reversed every other round. `enter(mode)` switches to a mode
    and returns its step; one untimed step follows each switch (it packs weights, or brings the
    mode's caches back)."""
    clock = step_clock()
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for r in range(args.rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            step = enter(mode)
            step()
            start = clock()
            for _ in range(args.window):
                step()
            times[mode].append(1000 * (clock() - start) / args.window)
    return {mode: sorted(v)[len(v) // 2] for mode, v in times.items()}


COMPARED = {  # what --compare-* times: its argument
    "packing": "compare_packing",
    "decode kernel": "compare_decode_kernel",
    "matmul kernel": "compare_matmul_kernel",
    "router kernel": "compare_router_kernel",
    "norm kernel": "compare_norm_kernel",
    "linear rows": "compare_linear_rows",
}
COMPARED_NAMES = {
    "packing": ("packed weights", "unpacked"),
    "decode kernel": ("decode kernel", "SDPA"),
    "matmul kernel": ("matmul kernels", "torch's matmuls"),
    "router kernel": ("router kernel", "torch's routing"),
    "norm kernel": ("RMSNorm kernel", "torch's norm"),
    "linear rows": (f"linear kernel <= {cpu_matmul.MAX_LINEAR_ROWS} rows", "<= {} rows"),
}


def compare_dtypes(model_dir: Path, args: argparse.Namespace) -> dict[str, float]:
    """Median ms per decode step of an fp32 and a bf16 engine, alternating, and fp32 / bf16."""
    size = args.concurrency + args.prefill_prompts
    engines = {dtype: build_engine(model_dir, dtype, size) for dtype in ("float32", "bfloat16")}
    max_tokens = args.warm_tokens + args.rounds * (args.window + 1) + 8
    for engine in engines.values():
        start_decoding(engine, args.concurrency, max_tokens, args.warm_tokens)
    steps = {dtype: joining(engine, args.prefill_prompts) for dtype, engine in engines.items()}
    med = alternating_windows(tuple(engines), steps.__getitem__, args)
    return med | {"ratio": med["float32"] / med["bfloat16"]}


def step_clock() -> Callable[[], float]:
    """The engine thread's CPU time with one torch thread; wall time with more (the kernels' other
    threads work for the step too)."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def batch_sweep(model_dir: Path, dtype: str, sizes: list[int], args: argparse.Namespace) -> dict[int, float]:
    """Median ms per decode step at each concurrency in `sizes`."""
    clock, curve = step_clock(), {}
    for size in sizes:
        engine = build_engine(model_dir, dtype, size)
        start_decoding(engine, size, args.warm_tokens + args.steps + 8, args.warm_tokens)
        times = []
        for _ in range(args.steps):
            start = clock()
            engine.step()
            times.append(1000 * (clock() - start))
        curve[size] = sorted(times)[len(times) // 2]
    return curve


def curve_ms(curve: dict[int, float], batch: int) -> float:
    """Step ms at `batch`, interpolated in log(batch) between measured sizes (flat beyond them)."""
    sizes = sorted(curve)
    i = bisect.bisect_left(sizes, batch)
    if i == 0:
        return curve[sizes[0]]
    if i == len(sizes):
        return curve[sizes[-1]]
    lo, hi = sizes[i - 1], sizes[i]
    f = (math.log(batch) - math.log(lo)) / (math.log(hi) - math.log(lo))
    return curve[lo] + f * (curve[hi] - curve[lo])


def modeled_tok_s(curve: dict[int, float], lengths: list[int], concurrency: int) -> float:
    """Tokens per second of requests decoding `lengths` tokens, at most `concurrency` at a time,
    when a step costs `curve_ms` of the sequences in it."""
    pending, running, ms, tokens = list(lengths), [], 0.0, 0
    while pending or running:
        while pending and len(running) < concurrency:
            running.append(pending.pop(0))
        ms += curve_ms(curve, len(running))
        tokens += len(running)
        running = [n - 1 for n in running if n > 1]
    return 1000 * tokens / ms


def print_sweep(label: str, curve: dict[int, float], concurrency: int) -> None:
    top = max(curve)
    print(f"\n{label}: decode step against batch (median ms per step; tok/s; share of tok/s at {top})")
    for size, ms in sorted(curve.items()):
        rate = 1000 * size / ms
        print(f"  batch {size:4d}: {ms:7.2f} ms  {rate:7.0f} tok/s  {rate / (1000 * top / curve[top]):5.0%}")
    for n in (128, 256):
        rng = random.Random(0)
        fixed = modeled_tok_s(curve, [128] * n, concurrency)
        mixed = modeled_tok_s(curve, [rng.randint(16, 256) for _ in range(n)], concurrency)
        print(
            f"  modeled, {n} requests at most {concurrency} in flight: fixed 128 tokens {fixed:.0f} tok/s, "
            f"mixed 16-256 {mixed:.0f} tok/s, mixed / fixed {mixed / fixed:.2f}"
        )


def print_report(label: str, ms: dict[str, float], ops: list, concurrency: int) -> None:
    step = ms["step"]
    print(f"\n{label}: {step:.2f} ms per decode step, {1000 * concurrency / step:.0f} tok/s (engine only)")
    for name in PHASES:
        print(f"  {name:18s} {ms[name]:7.2f} ms  {ms[name] / step:5.0%}")
    print("top aten/mkldnn ops (self CPU, whole step under torch.profiler):")
    print("  " + ", ".join(f"{name.split('::')[-1]} {share:.0%}" for name, share in ops))


def markdown_header() -> str:
    cols = ["model, dtype, engine", "step ms", "tok/s", *PHASES, "top aten ops"]
    return f"| {' | '.join(cols)} |\n" + "|---" * len(cols) + "|"


def markdown_row(label: str, ms: dict[str, float], ops: list, concurrency: int) -> str:
    step = ms["step"]
    cells = [label, f"{step:.2f}", f"{1000 * concurrency / step:.0f}", *(f"{ms[n]:.2f}" for n in PHASES)]
    cells.append(", ".join(f"{name.split('::')[-1]} {share:.0%}" for name, share in ops[:4]))
    return f"| {' | '.join(cells)} |"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="tiny-moe,moe-50m")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--steps", type=int, default=40, help="timed decode steps")
    p.add_argument("--warm-tokens", type=int, default=64, help="tokens decoded before the timed steps")
    p.add_argument("--profile-steps", type=int, default=5, help="decode steps under torch.profiler")
    p.add_argument("--top-ops", type=int, default=10)
    p.add_argument("--markdown", action="store_true", help="also print the rows of BENCHMARKS.md's table")
    p.add_argument("--label", default="", help="engine name in the markdown rows (e.g. before, after)")
    p.add_argument("--compare-packing", action="store_true", help="packed weights on against off (see above)")
    p.add_argument(
        "--compare-decode-kernel", action="store_true", help="the CPU decode kernel against SDPA (see above)"
    )
    p.add_argument(
        "--compare-matmul-kernel", action="store_true", help="the CPU matmul kernels against torch's (above)"
    )
    p.add_argument(
        "--compare-router-kernel", action="store_true", help="the CPU router kernel against torch's (above)"
    )
    p.add_argument(
        "--compare-norm-kernel", action="store_true", help="the CPU RMSNorm kernel against torch's (above)"
    )
    p.add_argument(
        "--compare-linear-rows",
        type=int,
        metavar="N",
        help="the linear kernel's row limit against N rows (above)",
    )
    p.add_argument(
        "--batch-sweep", metavar="SIZES", help="decode step time at these batch sizes, e.g. 1,4,16,64 (above)"
    )
    p.add_argument("--compare-dtypes", action="store_true", help="bf16 against fp32, one engine each (above)")
    p.add_argument("--rounds", type=int, default=12, help="--compare-*: windows of each mode")
    p.add_argument("--window", type=int, default=3, help="--compare-*: decode steps per window")
    p.add_argument(
        "--prefill-prompts",
        type=int,
        default=0,
        metavar="K",
        help="--compare-*: K new prompts join every timed step (above)",
    )
    args = p.parse_args()
    comparing = args.compare_dtypes or any(getattr(args, flag) for flag in COMPARED.values())
    if args.prefill_prompts < 0 or (args.prefill_prompts and not comparing):
        p.error("--prefill-prompts takes a count >= 0, with --compare-dtypes or another --compare-* mode")
    import asyncrl

    print(
        f"asyncrl from {Path(asyncrl.__file__).parent}; torch {torch.__version__}, "
        f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads, "
        f"{platform.machine()} {os.cpu_count()} cores"
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets.split(","):
            model_dir = Path(tmp) / preset
            init_model(preset, model_dir, seed=0)
            if args.compare_dtypes:
                r = compare_dtypes(model_dir, args)
                print(
                    f"{preset} {_batch(args)}: bfloat16 {r['bfloat16']:.2f} ms per decode step, "
                    f"float32 {r['float32']:.2f} ms: bf16 {r['ratio']:.2f}x fp32 (median of "
                    f"{args.rounds} windows of {args.window} steps each)",
                    flush=True,
                )
                continue
            for dtype in args.dtypes.split(","):
                if args.batch_sweep:
                    curve = batch_sweep(model_dir, dtype, [int(x) for x in args.batch_sweep.split(",")], args)
                    print_sweep(f"{preset} {dtype}", curve, args.concurrency)
                    continue
                compared = [w for w, flag in COMPARED.items() if getattr(args, flag)]
                if compared:
                    what = compared[0]
                    r = compare(model_dir, dtype, what, args)
                    on, off = COMPARED_NAMES[what]
                    off = off.format(args.compare_linear_rows)
                    print(
                        f"{preset} {dtype} {_batch(args)}: {on} {r['on']:.2f} ms per decode step, "
                        f"{off} {r['off']:.2f} ms: {r['ratio']:.2f}x (median of {args.rounds} windows of "
                        f"{args.window} steps each)",
                        flush=True,
                    )
                    continue
                ms, ops = profile(model_dir, dtype, args)
                print_report(f"{preset} {dtype} c={args.concurrency}", ms, ops, args.concurrency)
                rows.append(markdown_row(f"{preset}, {dtype}, {args.label}", ms, ops, args.concurrency))
    if args.markdown:
        print("\n" + "\n".join([markdown_header(), *rows]))


if __name__ == "__main__":
    main()
