"""Causal attention for bf16 training on CPU: torch's flash kernel against asyncrl's blocked matmuls.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_attention.py [--rounds 8] [--no-write]

For each shape [B rows, H query heads, G kv heads, T positions, head dim 64] it times, on the same
bf16 inputs (laid out as projections give them), forward + backward of
`F.scaled_dot_product_attention(..., is_causal=True, enable_gqa=True)` (the flash kernel) and of
`asyncrl.model.blocked_attention.blocked_causal_attention` with blocks of 32 and of 64 query
positions, and the forward alone (no autograd, as the engine's prefill runs it) of both. The runs
alternate round by round, each timed call right after an untimed call of the same run (so that
the allocator holds what the call needs, as in a training loop); each gets the median of
`--rounds` calls of process CPU time. It also prints each one's largest error against SDPA in fp64
(output and the three input gradients, relative to the largest reference value).

`asyncrl.model.compute` takes the blocked path for bf16 causal self-attention under autograd on
CPUs with AVX-512 BF16 and no AMX (docs/trainer.md, "bf16 on CPU"); this table is what that rule
and `BLOCK_QUERIES` rest on. Results replace the "## Training attention (CPU bf16)" section of
BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from asyncrl.model.blocked_attention import BLOCK_QUERIES, blocked_causal_attention
from asyncrl.model.compute import cpu_kernels
from report import machine, time_interleaved, write_section

SHAPES = [  # (B, H, G, T)
    (1, 8, 4, 128),
    (1, 8, 4, 512),
    (1, 8, 4, 1024),
    (1, 8, 4, 2048),
    (2, 8, 4, 512),
    (4, 8, 4, 256),
    (4, 8, 4, 512),
]
HEAD_DIM = 64


def _inputs(B: int, H: int, G: int, T: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)

    def make(heads: int) -> torch.Tensor:
        x = torch.randn(B, T, heads, HEAD_DIM, generator=gen).bfloat16()
        return x.transpose(1, 2).requires_grad_()

    return make(H), make(G), make(G), torch.randn(B, H, T, HEAD_DIM, generator=gen).bfloat16()


def _flash(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _blocked(block: int) -> Callable:
    return lambda q, k, v: blocked_causal_attention(q, k, v, block=block)


def _fwd_bwd(fn: Callable, q, k, v, do) -> Callable[[], None]:
    def run() -> None:
        for t in (q, k, v):
            t.grad = None
        fn(q, k, v).backward(do)

    return run


def _fwd(fn: Callable, q, k, v) -> Callable[[], None]:
    def run() -> None:
        with torch.no_grad():
            fn(q, k, v)

    return run


def _error(fn: Callable, q, k, v, do) -> float:
    """Largest relative error of the output and input gradients against SDPA in fp64."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q64, k64, v64, is_causal=True, enable_gqa=True)
    ref.backward(do.double())
    for t in (q, k, v):
        t.grad = None
    out = fn(q, k, v)
    out.backward(do)
    pairs = zip((out, q.grad, k.grad, v.grad), (ref, q64.grad, k64.grad, v64.grad), strict=True)
    return max(((a.double() - b).abs().max() / b.abs().max()).item() for a, b in pairs)


def bench(shape: tuple[int, int, int, int], rounds: int) -> dict:
    B, H, G, T = shape
    q, k, v, do = _inputs(B, H, G, T)
    fns = {"flash": _flash, "blocked 32": _blocked(32), "blocked 64": _blocked(64)}
    runs = {f"{name} fwd+bwd": _fwd_bwd(fn, q, k, v, do) for name, fn in fns.items()}
    runs |= {"flash fwd": _fwd(_flash, q, k, v), "blocked fwd": _fwd(_blocked(BLOCK_QUERIES), q, k, v)}
    seconds = time_interleaved([(run, rounds) for run in runs.values()])
    return {
        "shape": shape,
        "ms": {name: 1000 * t for name, t in zip(runs, seconds, strict=True)},
        "err_flash": _error(_flash, q, k, v, do),
        "err_blocked": _error(_blocked(BLOCK_QUERIES), q, k, v, do),
    }


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| B x H (G) x T | flash fwd+bwd ms | blocked 32 | blocked 64 | flash / blocked (default block) "
        "| forward only: flash / blocked | error vs fp64: flash, blocked |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        B, H, G, T = r["shape"]
        ms = r["ms"]
        chosen = ms[f"blocked {BLOCK_QUERIES} fwd+bwd"]
        lines.append(
            f"| {B} x {H} ({G}) x {T} | {ms['flash fwd+bwd']:.1f} | {ms['blocked 32 fwd+bwd']:.1f} | "
            f"{ms['blocked 64 fwd+bwd']:.1f} | {ms['flash fwd+bwd'] / chosen:.2f}x ({BLOCK_QUERIES}) | "
            f"{ms['flash fwd'] / ms['blocked fwd']:.2f}x | {r['err_flash']:.1e}, {r['err_blocked']:.1e} |"
        )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=8, help="timed calls of each run per shape")
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args()
    torch.manual_seed(0)
    rows = []
    for shape in SHAPES:
        rows.append(bench(shape, a.rounds))
        print(table(rows)[-1], flush=True)
    kernels = cpu_kernels()
    header = (
        f"bf16, head dim {HEAD_DIM}, inputs laid out as projections give them; median of {a.rounds} "
        f"calls of process CPU time per run, the runs alternating, each timed call after an untimed one "
        f"of the same run; errors are the largest of output and input gradients against SDPA in fp64, "
        f"relative to the largest reference value. The default block: {BLOCK_QUERIES} query positions.\n"
        f"Machine: {machine()}; torch CPU capability {kernels.isa}, {torch.get_num_threads()} thread(s) "
        f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}); torch {torch.__version__}.\n"
        "Command: `OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/bench_attention.py "
        f"--rounds {a.rounds}`"
    )
    body = "\n".join(table(rows))
    print(f"\n{header}\n\n{body}")
    if not a.no_write:
        title = "## Training attention (CPU bf16)"
        write_section(title, f"{title}\n\n{header}\n\n{body}\n")


if __name__ == "__main__":
    main()
