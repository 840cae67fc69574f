"""Forward+backward throughput of asyncrl's DeepSeek-V3, GLM-5 and GLM-4.5 models against transformers'.

    python benchmarks/bench_families.py [--steps 5] [--batch 4] [--seq 256] [--no-write]

The whole model of the presets tiny-dsv3 (DeepSeek-V3 / Kimi-K2: MLA, grouped sigmoid router,
shared expert), tiny-glm5 (GLM-5: MLA + DSA sparse attention) and tiny-glm4moe (GLM-4.5), fp32, at a
size that finishes in a few minutes on two busy cores. transformers loads each model from what our
`save_pretrained` writes, so both run the same weights; logits are checked equal first, then the
two alternate step by step (`bench_model._time_pair`). The table reports tokens/s and the ratio
(ours / transformers) and replaces its own section of BENCHMARKS.md. Qwen3-MoE's rows, bf16 and
MFU are bench_model.py's.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import tempfile

import torch
from transformers import AutoModelForCausalLM

from asyncrl.model import Transformer, preset_args, save_pretrained
from bench_model import _fwd_bwd, _time_pair, paired_models
from report import write_section

TITLE = "## Model: DeepSeek-V3, GLM-5, GLM-4.5"


def hf_model_via_disk(ours: Transformer):
    """transformers' model of any family, loaded from what save_pretrained writes."""
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(ours, tmp)
        return AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="sdpa").train()


def bench_family(preset: str, batch: int, seq: int, steps: int, **overrides) -> dict:
    """One whole-model row; `overrides` replace preset fields (named in the row)."""
    args = dataclasses.replace(preset_args(preset), **overrides)
    ours, hf, ids = paired_models(args, hf_model_via_disk, batch, seq)
    t_ours, t_hf = _time_pair(_fwd_bwd(ours, ids), _fwd_bwd(hf, ids), steps)
    tokens = batch * seq
    what = ", ".join([preset, *(f"{k}={v}" for k, v in overrides.items())])
    return {"what": f"whole model ({what})", "tokens": tokens, "ours": tokens / t_ours, "hf": tokens / t_hf}


def family_rows(steps: int, batch: int, seq: int) -> list[dict]:
    # seq must exceed index_topk (64) so that GLM-5's sparse path is what runs. 32 index heads as
    # in GLM-5 itself: with the preset's 8, index scores that are exactly zero (every relu term
    # zero) tie often enough that our position-ordered tie rule and transformers' topk keep
    # different keys, and the logits check would compare two different selections.
    assert seq > preset_args("tiny-glm5").index_topk, "--seq must exceed tiny-glm5's index_topk"
    return [
        bench_family("tiny-dsv3", batch, seq, steps),
        bench_family("tiny-glm5", batch, seq, steps, index_n_heads=32),
        bench_family("tiny-glm4moe", batch, seq, steps),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5, help="timed steps per implementation (after a warm-up)")
    p.add_argument("--batch", type=int, default=4, help="rows per step")
    p.add_argument("--seq", type=int, default=256, help="tokens per row (> 64)")
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args()
    torch.manual_seed(0)
    rows = family_rows(a.steps, a.batch, a.seq)
    table = "\n".join(
        [
            "| benchmark | tokens/step | asyncrl tok/s | transformers tok/s | ratio |",
            "|---|---|---|---|---|",
            *(
                f"| {r['what']} | {r['tokens']} | {r['ours']:.0f} | {r['hf']:.0f} | "
                f"{r['ours'] / r['hf']:.2f}x |"
                for r in rows
            ),
        ]
    )
    print(table)
    if a.no_write:
        return
    header = (
        f"{TITLE}\n\nForward+backward, fp32, same weights and inputs (logits checked equal first), "
        "median of the steps of one run; the two implementations alternate step by step, so load "
        "on the machine hits both alike and the ratio is the figure to read.\n"
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"{torch.get_num_threads()} torch threads, torch {torch.__version__}; shared with other jobs "
        f"(1-min load average {os.getloadavg()[0]:.1f} at the end), so absolute tok/s are noisy.\n"
        f"Command: `PYTHONPATH=src python benchmarks/bench_families.py --steps {a.steps} --batch {a.batch} "
        f"--seq {a.seq}`\n\n"
    )
    write_section(TITLE, header + table + "\n")


if __name__ == "__main__":
    main()
