"""Forward+backward throughput of asyncrl's MoE block and whole model against transformers' Qwen3-MoE.

    python benchmarks/bench_model.py [--steps 5] [--no-write]

Both implementations get the same weights and inputs in one process; the table reports tokens/s and
the ratio (ours / transformers). Results are appended to BENCHMARKS.md under "## Model".
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch
from transformers import Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from asyncrl.model import Transformer, preset_args, to_hf_state_dict
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


def bench_model(preset: str, batch: int, seq: int, steps: int) -> dict:
    ours = Transformer(preset_args(preset))
    ours.init_weights(seed=0)
    with torch.no_grad():
        for layer in ours.layers:
            if layer.is_moe:
                layer.mlp.gate.weight.normal_(std=0.5)  # spread tokens over experts
    hf = hf_model_from_ours(ours)
    ids = torch.randint(0, ours.args.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(ids).logits - hf(ids).logits).abs().max() < 1e-3
    t_ours, t_hf = _time_pair(_fwd_bwd(ours, ids), _fwd_bwd(hf, ids), steps)
    tokens = batch * seq
    return {"what": f"whole model ({preset})", "tokens": tokens, "ours": tokens / t_ours, "hf": tokens / t_hf}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args()
    torch.manual_seed(0)
    rows = [
        bench_block("tiny-moe", 4096, a.steps),
        bench_block("moe-50m", 4096, a.steps),
        bench_model("tiny-moe", 8, 512, a.steps),
        bench_model("moe-50m", 4, 512, a.steps),
    ]
    lines = [
        "| benchmark | tokens/step | asyncrl tok/s | transformers tok/s | ratio |",
        "|---|---|---|---|---|",
        *(
            f"| {r['what']} | {r['tokens']} | {r['ours']:.0f} | {r['hf']:.0f} | {r['ours'] / r['hf']:.2f}x |"
            for r in rows
        ),
    ]
    table = "\n".join(lines)
    print(table)
    if a.no_write:
        return
    header = (
        f"## Model\n\nForward+backward, fp32, same weights and inputs, one run.\n"
        f"Machine: {platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}.\n"
        f"Command: `python benchmarks/bench_model.py --steps {a.steps}`\n\n"
    )
    write_section("## Model", header + table + "\n")


if __name__ == "__main__":
    main()
