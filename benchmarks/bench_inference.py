"""Generation throughput of the embedded engine vs transformers `generate()`, same model and prompts.

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/bench_inference.py --preset tiny-moe [--write]

At concurrency c the engine keeps at most c sequences in flight (continuous batching: a finished
sequence is replaced at once); `generate()` runs the same requests in static batches of c, each
batch padded on the left and decoded until its longest request is done. Output lengths are mixed
(uniform in [min_new, max_new]) and EOS is ignored on both sides, so both produce exactly the
requested tokens; throughput counts requested tokens only. Greedy decoding; the engine in fp32 and
bf16, generate() in fp32; best of N interleaved repeats (one process).
With --write the table replaces the `## Inference engine` section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from asyncrl.config.inference import InferenceConfig
from asyncrl.inference import Engine, SamplingOptions
from asyncrl.model import from_pretrained, torch_dtype
from asyncrl.tools.init_model import init_model

SECTION = "## Inference engine"


def make_workload(n: int, seed: int, min_new: int, max_new: int) -> list[tuple[list[int], int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        plen = int(torch.randint(16, 65, (1,), generator=g))
        prompt = torch.randint(0, 256, (plen,), generator=g).tolist()
        out.append((prompt, int(torch.randint(min_new, max_new + 1, (1,), generator=g))))
    return out


def run_engine(model_dir: Path, workload, concurrency: int, dtype: str = "float32") -> float:
    cfg = InferenceConfig(
        model=str(model_dir), max_num_seqs=concurrency, device="cpu", kv_cache_tokens=65536, dtype=dtype
    )
    engine = Engine(from_pretrained(model_dir, dtype=torch_dtype(dtype)), cfg)
    for i, (prompt, n) in enumerate(workload):
        engine.add_request(str(i), prompt, SamplingOptions(temperature=0.0, max_tokens=n, ignore_eos=True))
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - t0


@torch.inference_mode()
def run_hf(model_dir: Path, workload, concurrency: int, pad_id: int) -> float:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    t0 = time.perf_counter()
    for start in range(0, len(workload), concurrency):
        batch = workload[start : start + concurrency]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        longest = max(n for _, n in batch)
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=longest,
            min_new_tokens=longest,
            do_sample=False,
            pad_token_id=pad_id,
        )
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny-moe")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--requests", type=int, nargs="+", default=[8, 64, 128], help="requests per concurrency")
    p.add_argument("--min-new", type=int, default=8)
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats; the best time of each counts")
    p.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = p.parse_args()
    torch.manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / args.preset
        model = init_model(args.preset, model_dir)
        pad_id = model.args.pad_token_id
        for c, n in zip(args.concurrency, args.requests):
            workload = make_workload(n, seed=c, min_new=args.min_new, max_new=args.max_new)
            tokens = sum(k for _, k in workload)
            t_engine, t_bf16, t_hf = float("inf"), float("inf"), float("inf")
            for _ in range(args.repeats):  # interleaved, best of N: the machine is shared and noisy
                t_engine = min(t_engine, run_engine(model_dir, workload, c))
                t_bf16 = min(t_bf16, run_engine(model_dir, workload, c, "bfloat16"))
                t_hf = min(t_hf, run_hf(model_dir, workload, c, pad_id))
            rows.append((c, n, tokens, tokens / t_engine, tokens / t_hf, tokens / t_bf16))
            print(
                f"c={c:3d} n={n:4d} tokens={tokens:6d} engine {tokens / t_engine:8.1f} tok/s  "
                f"generate() {tokens / t_hf:8.1f} tok/s  ratio {t_hf / t_engine:5.2f}x  "
                f"engine bf16 {tokens / t_bf16:8.1f} tok/s",
                flush=True,
            )
    table = render(rows, args)
    print(table)
    if args.write:
        write_section(Path(__file__).resolve().parents[1] / "BENCHMARKS.md", table)


def render(rows, args) -> str:
    """The `### <preset>` subsection of this run."""
    machine = (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}"
    )
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    cmd = f"PYTHONPATH=src OMP_NUM_THREADS={threads} python benchmarks/bench_inference.py " + " ".join(
        sys.argv[1:]
    )
    lines = [
        f"### {args.preset}",
        "",
        f"Machine: {machine}; shared with other jobs, so timings are noisy and only the ratios (same "
        f"process, interleaved, best of {args.repeats}) are meaningful. Model `{args.preset}` (random init), "
        f"greedy, CPU; generate() in fp32. Prompts 16-64 tokens; outputs uniform in [{args.min_new}, "
        f"{args.max_new}] tokens, EOS ignored.",
        "",
        f"Command: `{cmd.strip()}`",
        "",
        "| concurrency | requests | generated tokens | engine fp32 tok/s | generate() fp32 tok/s "
        "| engine / generate() | engine bf16 tok/s | engine bf16 / fp32 |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c, n, tokens, e, h, b in rows:
        lines.append(f"| {c} | {n} | {tokens} | {e:.0f} | {h:.0f} | {e / h:.2f}x | {b:.0f} | {b / e:.2f}x |")
    return "\n".join(lines) + "\n"


INTRO = (
    "Throughput of the embedded engine (continuous batching, at most c sequences in flight) vs "
    "transformers `generate()` on the same requests in static batches of c (left-padded, each batch "
    "decoded until its longest request is done). Written by `benchmarks/bench_inference.py --write`.\n"
)


def write_section(path: Path, table: str) -> None:
    """Replace this preset's subsection inside `## Inference engine`, creating either as needed."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    section_re = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", re.S | re.M)
    match = section_re.search(text)
    body = match.group(0) if match else f"{SECTION}\n\n{INTRO}"
    preset = table.splitlines()[0]
    sub_re = re.compile(rf"^{re.escape(preset)}\n.*?(?=^### |\Z)", re.S | re.M)
    body = sub_re.sub(table + "\n", body) if sub_re.search(body) else body.rstrip() + "\n\n" + table + "\n"
    if match:
        text = text[: match.start()] + body + text[match.end() :]
    else:
        text = text.rstrip() + "\n\n" + body
    path.write_text(text.rstrip() + "\n")


if __name__ == "__main__":
    main()
