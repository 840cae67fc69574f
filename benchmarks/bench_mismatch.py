"""Trainer-inference mismatch: router replay (R3), FP8 block-scale, and the exact fp32 mode.

    OMP_NUM_THREADS=2 python benchmarks/bench_mismatch.py [--prompts 16 --max-tokens 48] [--no-write]

For each MoE preset (tiny-moe, moe-50m): write a random-init model (router and LM-head weights
scaled up, see `build_model_dir`), sample rollouts with the embedded engine
(`asyncrl.inference.engine.Engine`) at a given precision, then recompute the sampled tokens'
logprobs with the trainer's code (`pack_samples` + `asyncrl.model` + `chunked_logprobs`) at
another precision, with router replay off and on. Settings:

  1. bf16 inference vs fp32 trainer (and vs bf16 trainer): mismatch KL and routing agreement, R3 off/on
  2. FP8 inference (bf16 + FP8 block-scale linears) vs bf16 trainer, and vs FP8 trainer (matched)
  3. fp32 inference vs fp32 trainer: exact mode

Prints a table and writes the "## Mismatch" section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from asyncrl.config.inference import InferenceConfig
from asyncrl.config.trainer import OptimConfig, ScheduleConfig, TrustRegionLossConfig
from asyncrl.distributed import DistInfo
from asyncrl.inference.engine import Engine
from asyncrl.inference.request import SamplingOptions
from asyncrl.model import Transformer, from_pretrained, save_pretrained
from asyncrl.model.fp8 import apply_fp8
from asyncrl.tools.init_model import init_model
from asyncrl.trainer.logprobs import chunked_logprobs
from asyncrl.trainer.loss import rl_loss
from asyncrl.trainer.mismatch import MismatchSums, mismatch_sums, routing_agreement
from asyncrl.trainer.optim import build_optimizer, build_scheduler
from asyncrl.trainer.packing import pack_samples
from asyncrl.trainer.step import StepRunner
from asyncrl.wire import RolloutSample
from report import write_section

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ("tiny-moe", "moe-50m")
ROUTER_SCALE, HEAD_SCALE = 10.0, 10.0
# (inference precision, trainer precision); "fp8" = bf16 weights + FP8 block-scale linears
SETTINGS = [
    ("bf16", "fp32"),
    ("bf16", "bf16"),
    ("fp8", "bf16"),
    ("fp8", "fp8"),
    ("fp32", "fp32"),
]


def build_model_dir(preset: str, out: Path, seed: int) -> Path:
    """Random init (N(0, 0.02)), then router and LM-head weights x10: at plain init every router is
    near-uniform (top-k decided by noise) and next-token distributions are nearly flat, neither of
    which looks like a trained model."""
    model = init_model(preset, out, seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(ROUTER_SCALE)
        if not model.args.tie_word_embeddings:
            model.lm_head.weight.mul_(HEAD_SCALE)
    save_pretrained(model, out)
    return out


def load(model_dir: Path, precision: str) -> Transformer:
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    model = from_pretrained(str(model_dir), dtype=dtype)
    if precision == "fp8":
        apply_fp8(model, backend="emulated")
    return model.eval()


def build_engine(model_dir: Path, precision: str, num_seqs: int, max_tokens: int) -> Engine:
    cfg = InferenceConfig(
        model=str(model_dir),
        dtype="float32" if precision == "fp32" else "bfloat16",
        device="cpu",
        kv_cache_tokens=num_seqs * (64 + max_tokens) + 512,
        max_model_len=512,
        seed=0,
    )
    return Engine(load(model_dir, precision), cfg)


def generate(
    engine: Engine, prompts: list[list[int]], max_tokens: int, tag: str = "r"
) -> list[RolloutSample]:
    """Sample one completion per prompt (temperature 1) with routed experts; one RolloutSample each."""
    opts = SamplingOptions(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}{i}", prompt, opts, return_routed_experts=True)
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    routing: dict[str, np.ndarray] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            logprobs.setdefault(out.request_id, []).extend(out.new_logprobs)
            if out.finished:
                routing[out.request_id] = np.asarray(out.routed_experts)
    ids = [f"{tag}{i}" for i in range(len(prompts))]
    return [_sample(p, tokens[r], logprobs[r], routing[r], engine.version) for p, r in zip(prompts, ids)]


def rollouts(
    model_dir: Path, precision: str, prompts: list[list[int]], max_tokens: int
) -> list[RolloutSample]:
    return generate(build_engine(model_dir, precision, len(prompts), max_tokens), prompts, max_tokens)


def _sample(
    prompt: list[int], completion: list[int], logprobs: list[float], routed: np.ndarray, version: int
) -> RolloutSample:
    n_p, n = len(prompt), len(prompt) + len(completion)
    return RolloutSample(
        token_ids=np.array(prompt + completion, np.int32),
        loss_mask=np.arange(n) >= n_p,
        inference_logprobs=np.array([0.0] * n_p + logprobs, np.float32),
        advantages=np.zeros(n, np.float32),
        temperatures=np.ones(n, np.float32),
        policy_versions=np.full(n, version, np.int32),
        routed_experts=routed,
    )


@dataclass(frozen=True, kw_only=True)
class Score:
    sums: MismatchSums
    agreement_L: list[float]  # per MoE layer


@torch.no_grad()
def score(model: Transformer, samples: list[RolloutSample], replay: bool) -> Score:
    """Trainer-side logprobs of the sampled tokens and routing agreement with the engine's routing."""
    total, agree = MismatchSums(), []
    moe = model.args.moe_layers
    for mb in pack_samples(samples, seq_len=2048, replay=True):
        out = model(
            mb.input_ids,
            mb.position_ids,
            routed_experts=mb.routed_experts if replay else None,
            return_routing=True,
            compute_logits=False,
        )
        lp, _ = chunked_logprobs(
            out.hidden_states[0], model.lm_head.weight, mb.target_ids, mb.temperatures, 512
        )
        total = total + mismatch_sums(lp, mb.inference_logprobs, mb.loss_mask)
        own = out.router_topk if replay else out.routed_experts
        agree.append(
            routing_agreement(mb.routed_experts[0], own[0], mb.loss_mask, moe) * int(mb.loss_mask.sum())
        )
    agreement_L = (torch.stack(agree).sum(0) / total.num_tokens).tolist()
    return Score(sums=total, agreement_L=agreement_L)


def run_preset(preset: str, root: Path, num_prompts: int, max_tokens: int, seed: int) -> list[dict]:
    model_dir = build_model_dir(preset, root / preset, seed)
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 48, (num_prompts,), generator=gen).tolist()
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]
    samples = {}
    for inf in sorted({s[0] for s in SETTINGS}):
        t0 = time.perf_counter()
        samples[inf] = rollouts(model_dir, inf, prompts, max_tokens)
        print(f"  {preset}: {inf} rollouts in {time.perf_counter() - t0:.1f}s", flush=True)
    rows = []
    for inf, trn in SETTINGS:
        model = load(model_dir, trn)
        off, on = score(model, samples[inf], replay=False), score(model, samples[inf], replay=True)
        rows.append({"preset": preset, "inference": inf, "trainer": trn, "off": off, "on": on})
    return rows


def _fmt_row(r: dict) -> str:
    off, on = r["off"].sums.metrics(), r["on"].sums.metrics()
    kl_off, kl_on = off["mismatch_kl"], on["mismatch_kl"]
    ratio = f"{kl_off / kl_on:.2f}x" if kl_on > 0 else "n/a"
    a_off, a_on = np.mean(r["off"].agreement_L), np.mean(r["on"].agreement_L)
    return (
        f"| {r['preset']} | {r['inference']} | {r['trainer']} | {kl_off:.2e} | {kl_on:.2e} | {ratio} | "
        f"{off['mismatch_kl_max']:.2e} | {on['mismatch_kl_max']:.2e} | "
        f"{off['mismatch_ratio_outside']:.4f} | {on['mismatch_ratio_outside']:.4f} | "
        f"{a_off:.4f} (min {min(r['off'].agreement_L):.3f}) | {a_on:.4f} |"
    )


def render(rows: list[dict]) -> str:
    lines = [
        "| preset | inference | trainer | KL R3 off | KL R3 on | off/on | max KL off | max KL on | "
        "outside [0.5,2] off | outside on | routing agreement off (worst layer) | agreement on |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    return "\n".join(lines + [_fmt_row(r) for r in rows])


# -- short RL comparison: bf16 engine, fp32 trainer, R3 off vs on ----------------------------------
LOWERCASE = np.arange(ord("a"), ord("z") + 1)


def _with_group_advantages(samples: list[RolloutSample], group: int) -> list[RolloutSample]:
    """Reward = share of lowercase letters in the completion; advantage = reward - group mean."""
    rewards = np.array([np.isin(s.token_ids[s.loss_mask], LOWERCASE).mean() for s in samples])
    adv = rewards - rewards.reshape(-1, group).mean(axis=1).repeat(group)
    return [
        dataclasses.replace(s, advantages=np.where(s.loss_mask, a, 0.0).astype(np.float32), reward=float(r))
        for s, a, r in zip(samples, adv, rewards)
    ]


def rl_curve(
    model_dir: Path,
    replay: bool,
    steps: int,
    num_prompts: int,
    group: int,
    max_tokens: int,
    lr: float,
    seed: int,
) -> list[tuple[float, float, float]]:
    """(mean reward, trainer's mismatch KL, masked fraction) per step; weights go trainer -> engine
    (bf16) each step."""
    torch.manual_seed(seed)
    trainer = load(model_dir, "fp32").train()
    optimizer = build_optimizer(trainer, OptimConfig(lr=lr))
    scheduler = build_scheduler(optimizer, ScheduleConfig(), max_steps=steps)
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    stepper = StepRunner(trainer, optimizer, scheduler, info, max_grad_norm=1.0, chunk_size=512)
    engine = build_engine(model_dir, "bf16", num_prompts * group, max_tokens)
    gen, loss_cfg, curve = torch.Generator().manual_seed(seed), TrustRegionLossConfig(), []
    for n in range(1, steps + 1):
        prompts = [torch.randint(0, 256, (16,), generator=gen).tolist() for _ in range(num_prompts)]
        batch = generate(engine, [p for p in prompts for _ in range(group)], max_tokens, tag=f"s{n}-")
        batch = _with_group_advantages(batch, group)
        result = stepper.step(
            pack_samples(batch, 2048, replay=replay),
            lambda inp, k: rl_loss(inp, loss_cfg, k),
            trained_version=n - 1,
        )
        engine.load_weights(
            {k: v.detach().to(torch.bfloat16, copy=True) for k, v in trainer.state_dict().items()}, n
        )
        curve.append((float(np.mean([s.reward for s in batch])), result.mismatch_kl, result.masked_fraction))
        print(
            f"  rl R3={'on' if replay else 'off'} step {n}: reward {curve[-1][0]:.3f} kl {curve[-1][1]:.2e}"
        )
    return curve


def render_rl(off: list[tuple[float, float, float]], on: list[tuple[float, float, float]]) -> str:
    lines = [
        "| step | reward R3 off | reward R3 on | mismatch KL R3 off | mismatch KL R3 on "
        "| masked off | masked on |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {i + 1} | {a[0]:.3f} | {b[0]:.3f} | {a[1]:.2e} | {b[1]:.2e} | {a[2]:.4f} | {b[2]:.4f} |"
        for i, (a, b) in enumerate(zip(off, on))
    ]
    mean = [float(np.mean([c[1] for c in curve])) for curve in (off, on)]
    lines.append(f"| mean | | | {mean[0]:.2e} | {mean[1]:.2e} | off/on {mean[0] / mean[1]:.2f}x | |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--presets", nargs="*", default=list(PRESETS), help="none: only the RL comparison")
    p.add_argument(
        "--rl-steps", type=int, default=0, help="steps of the R3 off/on RL run on tiny-moe (0: skip)"
    )
    p.add_argument("--rl-lr", type=float, default=1e-3)
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args()
    machine = f"Machine: {platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}.\n"
    with tempfile.TemporaryDirectory() as tmp:
        if a.presets:
            rows = [
                r
                for preset in a.presets
                for r in run_preset(preset, Path(tmp), a.prompts, a.max_tokens, a.seed)
            ]
            table = render(rows)
            print(table)
            header = (
                "## Mismatch\n\n"
                "Mismatch KL (k3, mean over sampled tokens) between the embedded engine's logprobs "
                "and the trainer's\n"
                f"recomputation, R3 off/on; {a.prompts} prompts x {a.max_tokens} sampled tokens "
                "(temperature 1) per\n"
                f"preset, random init with router and LM head x{ROUTER_SCALE:g}. One run. "
                "Analysis: docs/mismatch.md.\n"
                + machine
                + f"Command: `python benchmarks/bench_mismatch.py --prompts {a.prompts} --max-tokens "
                f"{a.max_tokens}`\n\n"
            )
            if not a.no_write:
                write_section("## Mismatch", header + table + "\n")
        if a.rl_steps:
            model_dir = build_model_dir("tiny-moe", Path(tmp) / "rl", a.seed)
            kw = dict(steps=a.rl_steps, num_prompts=4, group=4, max_tokens=24, lr=a.rl_lr, seed=a.seed)
            table = render_rl(rl_curve(model_dir, False, **kw), rl_curve(model_dir, True, **kw))
            print(table)
            header = (
                "## Mismatch: short RL run, R3 off vs on\n\n"
                "tiny-moe (random init, router and LM head x10), bf16 engine, fp32 trainer, "
                "trust-region loss,\n"
                f"lr {a.rl_lr:g}, 4 prompts x 4 samples x 24 tokens per step; "
                "reward = share of lowercase letters.\n"
                + machine
                + f"Command: `python benchmarks/bench_mismatch.py --presets --rl-steps {a.rl_steps}`\n\n"
            )
            if not a.no_write:
                write_section("## Mismatch: short RL run, R3 off vs on", header + table + "\n")


if __name__ == "__main__":
    main()
