"""GPU check: trainer MFU, FP8 block-scale matmul, engine decode tok/s and exact mode on one GPU.

    bash scripts/gpu_check.sh                      # = PYTHONPATH=src python benchmarks/gpu_check.py --out DIR
    python benchmarks/gpu_check.py --device cpu --tiny --out /tmp/gc   # every section at toy size (< 30 s)
    python benchmarks/gpu_check.py --from-json DIR/gpu_check.json --write   # BENCHMARKS.md "## GPU check"

Sized for one H200 in under 5 minutes, with the machine's own PyTorch (2.11 there) and nothing
installed. Sections (each with a time budget, each failure recorded without stopping the others):

  env          torch, CUDA, device, which optional torch APIs exist, whether the engine imports
  matmul_peak  achieved bf16 FLOP/s of an 8192^3 matmul: the MFU denominator of this run
  trainer      bf16 forward + backward (chunked-LM-head logprobs) of MOE_1B_ACTIVE on packed rows,
               grouped GEMM (F.grouped_mm) where torch has it; tokens/s and MFU; a check that the
               grouped GEMM matches the per-expert loop (outputs and weight gradients)
  fp8          block-scale FP8 vs fp32 (emulated), the scaled_mm kernel vs the emulation, and
               fp8_linear vs bf16 F.linear speed (skipped with the reason where the kernel can't run)
  exact        fp32 engine vs the trainer's fp32 recomputation on the device: mismatch KL ~ 0
  weights      one policy version (moe-50m in bf16) over an update channel between two processes:
               NCCL, one GPU each (skipped on a node with one GPU), gloo on the CPU; bit-identical
               to the sender's serving tensors, seconds and MB/s
  decode       the in-process inference engine at concurrency 64 and 256: steady-state decode tok/s

It writes DIR/gpu_check.json and DIR/gpu_check.md (the table) and exits 1 if any check failed or
any section raised. MFU = train FLOPs/s over the measured peak, with train FLOPs per token =
6 x active non-embedding parameters + 12 x layers x heads x head_dim x mean context (fwd + bwd).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from asyncrl.model import ModelArgs, preset_args
from asyncrl.model.presets import PRESETS
from gpu_check_sections import (
    Ctx,
    Section,
    Sizes,
    decode_section,
    env_section,
    exact_section,
    fp8_section,
    matmul_peak_section,
    trainer_section,
)
from gpu_check_weights import weights_section
from report import BENCHMARKS, write_section

TITLE = "## GPU check"

# ~1B active (0.98B; 6.6B in all): 16 layers, d2048, GQA 16/4 x 128, 64 experts top-8 of width
# 1024 (an OLMoE-1B-7B-like shape), on the byte-level vocabulary of the other presets. Defined here,
# not in asyncrl.model.presets: nothing else uses it, and at 6.6B it is no model to train on CPU.
MOE_1B_ACTIVE = ModelArgs(
    model_type="qwen3_moe",
    vocab_size=PRESETS["tiny-moe"].vocab_size,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=64,
    num_experts_per_tok=8,
    moe_intermediate_size=1024,
    norm_topk_prob=True,
    max_position_embeddings=8192,
    rope_theta=1e6,
    bos_token_id=PRESETS["tiny-moe"].bos_token_id,
    eos_token_id=PRESETS["tiny-moe"].eos_token_id,
    pad_token_id=PRESETS["tiny-moe"].pad_token_id,
)

FULL = Sizes(
    model_name="moe-1b-active",
    model=MOE_1B_ACTIVE,
    dtype=torch.bfloat16,
    exact_preset="moe-50m",
    peak_dim=8192,
    train_rows=4,
    train_seq_len=4096,
    train_sample_len=1024,
    train_steps=5,
    fp8_check_shapes=((256, 512, 384), (1, 128, 128), (333, 1024, 256), (4096, 2048, 1024)),
    fp8_speed_shapes=((16384, 2048, 2048), (16384, 8192, 8192)),
    fp8_iters=20,
    decode_concurrency=(64, 256),
    decode_prompt_len=128,
    decode_new_tokens=128,
    exact_prompts=16,
    exact_new_tokens=32,
    weights_model_name="moe-50m",
    weights_model=preset_args("moe-50m"),
)
TINY = Sizes(
    model_name="tiny-moe",
    model=preset_args("tiny-moe"),
    dtype=torch.float32,
    exact_preset="tiny-moe",
    peak_dim=256,
    train_rows=2,
    train_seq_len=128,
    train_sample_len=32,
    train_steps=2,
    fp8_check_shapes=((64, 256, 128), (1, 128, 128)),
    fp8_speed_shapes=((128, 256, 256),),
    fp8_iters=3,
    decode_concurrency=(64, 256),
    decode_prompt_len=8,
    decode_new_tokens=4,
    exact_prompts=4,
    exact_new_tokens=8,
    weights_model_name="tiny-moe",
    weights_model=preset_args("tiny-moe"),
)

# Seconds per section; no section starts past --time-limit, and each ends by the earlier of the two.
BUDGETS_S = {"env": 5, "matmul_peak": 15, "trainer": 70, "fp8": 40, "exact": 40, "weights": 40, "decode": 100}
GRACE_S = 30  # past its budget a section is interrupted (a loop that ignores its deadline, a hang)


SECTIONS: dict[str, Callable[[Ctx], Section]] = {
    "env": env_section,
    "matmul_peak": matmul_peak_section,
    "trainer": trainer_section,
    "fp8": fp8_section,
    "exact": exact_section,
    "weights": weights_section,
    "decode": decode_section,  # last: the longest, and its time budget cuts it short cleanly
}


class SectionTimeout(Exception):
    pass


@contextlib.contextmanager
def hard_limit(seconds: float) -> Iterator[None]:
    """Raise SectionTimeout in the main thread after `seconds` (where SIGALRM exists)."""
    if not hasattr(signal, "SIGALRM"):
        yield
        return

    def _raise(signum, frame):
        raise SectionTimeout(f"interrupted after {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1.0))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_section(name: str, ctx: Ctx) -> dict:
    start = time.perf_counter()
    try:
        with hard_limit(ctx.time_left() + GRACE_S):
            sec = SECTIONS[name](ctx)
        checks = {k: dataclasses.asdict(c) for k, c in sec.checks.items()}
        failed = any(c["passed"] is False for c in checks.values())
        record = {"status": "failed" if failed else "ok", "metrics": sec.metrics, "checks": checks}
    except Exception as err:  # the script's top level: one broken section must not hide the others
        record = {
            "status": "error",
            "error": f"{type(err).__name__}: {err}",
            "traceback": traceback.format_exc(limit=-6),
        }
    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    record["seconds"] = round(time.perf_counter() - start, 2)
    return record


def run(args: argparse.Namespace, device: torch.device) -> dict:
    started = time.time()
    end = time.perf_counter() + args.time_limit - (started - (args.launched_at or started))
    ctx = Ctx(device=device, sizes=TINY if args.tiny else FULL, seed=args.seed, deadline=0.0)
    sections = {}
    for name in args.sections:
        left = end - time.perf_counter()
        if left < 5:
            sections[name] = {
                "status": "not run",
                "reason": f"--time-limit {args.time_limit:g} s reached",
                "seconds": 0,
            }
            continue
        ctx.deadline = time.perf_counter() + min(BUDGETS_S[name], left)
        sections[name] = run_section(name, ctx)
        print(f"[gpu_check] {name}: {sections[name]['status']} ({sections[name]['seconds']} s)", flush=True)
    passed = all(s["status"] == "ok" for s in sections.values())
    return {
        "meta": {
            "command": "python benchmarks/gpu_check.py " + " ".join(sys.argv[1:]),
            "mode": "tiny" if args.tiny else "full",
            "device": str(device),
            "started_unix": round(started),
            "sections_s": round(time.time() - started, 1),
            # from the launch of scripts/gpu_check.sh (interpreter start and imports included)
            "wall_s": None if args.launched_at is None else round(time.time() - args.launched_at, 1),
        },
        "sections": sections,
        "passed": passed,
    }


# -- report -------------------------------------------------------------------------------------
def _fmt(key: str, value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.1%}" if key.endswith("mfu") else f"{value:.4g}"
    return str(value)


def _check_cell(check: dict) -> str:
    if check["passed"] is None:
        return f"SKIP ({check['skipped']})"
    cell = "PASS" if check["passed"] else "FAIL"
    if check["value"] is not None:
        cell += f" {_fmt('', check['value'])}" + (
            f" (limit {_fmt('', check['limit'])})" if check["limit"] else ""
        )
    return cell + (f"; {check['note']}" if check.get("note") else "")


def render_table(result: dict) -> str:
    lines = ["| section | measurement | value |", "|---|---|---|"]
    for name, sec in result["sections"].items():
        lines.append(f"| {name} | status | {sec['status']} ({sec['seconds']} s) |")
        if sec["status"] == "error":
            lines.append(f"| {name} | error | {sec['error'].replace('|', '/')[:300]} |")
        if sec["status"] == "not run":
            lines.append(f"| {name} | reason | {sec['reason']} |")
        for key, value in sec.get("metrics", {}).items():
            lines.append(f"| {name} | {key} | {_fmt(key, value)} |")
        for key, check in sec.get("checks", {}).items():
            lines.append(f"| {name} | check: {key} | {_check_cell(check)} |")
    return "\n".join(lines) + "\n"


def render_section(result: dict) -> str:
    meta, env = result["meta"], result["sections"].get("env", {}).get("metrics", {})
    machine = (
        f"{env.get('device')} (compute capability {env.get('capability')}), torch {env.get('torch')}, "
        f"CUDA {env.get('cuda')}, Python {env.get('python')}"
    )
    command = "bash scripts/gpu_check.sh"
    if set(result["sections"]) != set(SECTIONS):
        command += " --sections " + " ".join(result["sections"])
    took = f"{meta['wall_s']} s in all" if meta.get("wall_s") else f"{meta['sections_s']} s for the sections"
    return (
        f"{TITLE}\n\n"
        f"One run of `{command}` ({took}) on {machine}.\n"
        "MFU = train FLOPs/s over the bf16 matmul peak measured in the same run; train FLOPs per token = "
        "6 x active non-embedding parameters + 12 x layers x heads x head_dim x mean context. Decode tok/s "
        "counts the steady state (every sequence decoding); e2e includes prefill. How to run and what "
        "each section measures: docs/gpu-check.md.\n\n" + render_table(result)
    )


# -- entry point --------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="toy sizes (the CPU smoke test)")
    p.add_argument(
        "--out", type=Path, default=Path("outputs/gpu_check"), help="folder of the JSON and the table"
    )
    p.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS))
    p.add_argument(
        "--time-limit",
        type=float,
        default=270.0,
        help="seconds from the launch after which no section starts",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--launched-at", type=float, help="unix time of the launch (set by scripts/gpu_check.sh)")
    p.add_argument("--from-json", type=Path, help="render an earlier run's JSON instead of running")
    p.add_argument("--write", action="store_true", help=f"replace the '{TITLE}' section of BENCHMARKS.md")
    p.add_argument("--benchmarks", type=Path, default=BENCHMARKS, help="the file --write edits")
    return p.parse_args(argv)


def resolve_device(name: str, tiny: bool) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: --device cuda but torch sees no CUDA device")
    if name == "cpu" and not tiny:
        raise SystemExit(
            "gpu_check: the full sizes are for one GPU (a 6.6B-parameter MoE); on CPU add --tiny"
        )
    return torch.device(name)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        result = json.loads(args.from_json.read_text())
    else:
        result = run(args, resolve_device(args.device, args.tiny))
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.out / "gpu_check.md").write_text(render_table(result))
        print(f"[gpu_check] wrote {args.out / 'gpu_check.json'} and {args.out / 'gpu_check.md'}")
    print(render_table(result))
    if args.write:
        if result["meta"]["mode"] != "full" or not result["meta"]["device"].startswith("cuda"):
            raise SystemExit(
                "gpu_check: --write records a full-size GPU run; this result is from "
                f"mode {result['meta']['mode']!r} on {result['meta']['device']!r}"
            )
        write_section(TITLE, render_section(result), args.benchmarks)
        print(f"[gpu_check] wrote the '{TITLE}' section of {args.benchmarks}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
