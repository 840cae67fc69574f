"""Forward+backward throughput of asyncrl's model against transformers', same weights.

    python benchmarks/bench_model.py [--steps 5] [--no-write]
    python benchmarks/bench_model.py --families [--steps 5] [--batch 4] [--seq 256] [--no-write]

The default run compares Qwen3-MoE (the MoE block and the whole model, presets tiny-moe and
moe-50m) and writes the "## Model" section of BENCHMARKS.md. `--families` compares the whole
model of the presets tiny-dsv3 (DeepSeek-V3 / Kimi-K2: MLA, grouped sigmoid router, shared
expert), tiny-glm5 (GLM-5: MLA + DSA sparse attention) and tiny-glm4moe (GLM-4.5) at a smaller
size that finishes in a few minutes on two busy cores, and writes its own section. Both
implementations get the same weights and inputs in one process; the table reports tokens/s and
the ratio (ours / transformers).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from asyncrl.model import Transformer, preset_args, save_pretrained, to_hf_state_dict
from asyncrl.model.moe import MoE
from report import write_section

ROOT = Path(__file__).resolve().parents[1]


def _time_pair(fn_a, fn_b, steps: int) -> tuple[float, float]:
    """Median seconds per call of two functions, interleaved so that machine noise hits both alike."""
    fn_a(), fn_b()  # warm-up
    times_a, times_b = [], []
    for _ in range(steps):
        for fn, times in ((fn_a, times_a), (fn_b, times_b)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(times_a), statistics.median(times_b)


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


def hf_model_via_disk(ours: Transformer):
    """transformers' model of any family, loaded from what save_pretrained writes."""
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(ours, tmp)
        return AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="sdpa").train()


def bench_block(preset: str, tokens: int, steps: int) -> dict:
    args = preset_args(preset)
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
    t_ours, t_hf = _time_pair(_fwd_bwd(ours, x), _fwd_bwd(hf, x), steps)
    return {"what": f"MoE block ({preset})", "tokens": tokens, "ours": tokens / t_ours, "hf": tokens / t_hf}


def bench_model(preset: str, batch: int, seq: int, steps: int, **overrides) -> dict:
    """Whole-model rows; `overrides` replace preset fields (named in the row)."""
    ours = Transformer(dataclasses.replace(preset_args(preset), **overrides))
    ours.init_weights(seed=0)
    with torch.no_grad():
        for layer in ours.layers:
            if layer.is_moe:
                layer.mlp.gate.weight.normal_(std=0.5)  # spread tokens over experts
    hf = hf_model_from_ours(ours) if ours.args.model_type == "qwen3_moe" else hf_model_via_disk(ours)
    ids = torch.randint(0, ours.args.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(ids).logits - hf(ids).logits).abs().max() < 1e-3
    t_ours, t_hf = _time_pair(_fwd_bwd(ours, ids), _fwd_bwd(hf, ids), steps)
    tokens = batch * seq
    what = ", ".join([preset, *(f"{k}={v}" for k, v in overrides.items())])
    return {"what": f"whole model ({what})", "tokens": tokens, "ours": tokens / t_ours, "hf": tokens / t_hf}


FAMILIES_TITLE = "## Model: DeepSeek-V3, GLM-5, GLM-4.5"


def _family_rows(steps: int, batch: int, seq: int) -> list[dict]:
    """Whole-model rows of the sigmoid-router families (a separate, smaller run: see the docstring)."""
    # seq must exceed index_topk (64) so that GLM-5's sparse path is what runs. 32 index heads as
    # in GLM-5 itself: with the preset's 8, index scores that are exactly zero (every relu term
    # zero) tie often enough that our position-ordered tie rule and transformers' topk keep
    # different keys, and the logits check would compare two different selections.
    assert seq > preset_args("tiny-glm5").index_topk
    return [
        bench_model("tiny-dsv3", batch, seq, steps),
        bench_model("tiny-glm5", batch, seq, steps, index_n_heads=32),
        bench_model("tiny-glm4moe", batch, seq, steps),
    ]


def _table(rows: list[dict]) -> str:
    return "\n".join(
        [
            "| benchmark | tokens/step | asyncrl tok/s | transformers tok/s | ratio |",
            "|---|---|---|---|---|",
            *(
                f"| {r['what']} | {r['tokens']} | {r['ours']:.0f} | {r['hf']:.0f} | {r['ours'] / r['hf']:.2f}x |"
                for r in rows
            ),
        ]
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--no-write", action="store_true")
    p.add_argument(
        "--families",
        action="store_true",
        help="the DeepSeek-V3 / GLM-5 / GLM-4.5 rows instead of Qwen3-MoE's",
    )
    p.add_argument("--batch", type=int, default=4, help="rows per step (--families)")
    p.add_argument("--seq", type=int, default=256, help="tokens per row (--families; > 64)")
    a = p.parse_args()
    torch.manual_seed(0)
    if a.families:
        rows = _family_rows(a.steps, a.batch, a.seq)
        title = FAMILIES_TITLE
        command = f"--families --steps {a.steps} --batch {a.batch} --seq {a.seq}"
    else:
        rows = [
            bench_block("tiny-moe", 4096, a.steps),
            bench_block("moe-50m", 4096, a.steps),
            bench_model("tiny-moe", 8, 512, a.steps),
            bench_model("moe-50m", 4, 512, a.steps),
        ]
        title, command = "## Model", f"--steps {a.steps}"
    table = _table(rows)
    print(table)
    if a.no_write:
        return
    header = (
        f"{title}\n\nForward+backward, fp32, same weights and inputs (logits checked equal first), "
        "median of the steps of one run; the two implementations alternate step by step, so load "
        "on the machine hits both alike and the ratio is the figure to read.\n"
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"{torch.get_num_threads()} torch threads, torch {torch.__version__}; shared with other jobs "
        f"(1-min load average {os.getloadavg()[0]:.1f} at the end), so absolute tok/s are noisy.\n"
        f"Command: `PYTHONPATH=src python benchmarks/bench_model.py {command}`\n\n"
    )
    write_section(title, header + table + "\n")


if __name__ == "__main__":
    main()
