"""The reverse-text demo (examples/reverse_text) at reduced size: SFT on imperfect data, then async RL.

- SFT with the demo's init and stop rule reaches copying on the demo's own task (3-5 letters) for
  two seeds, well before its cap: the copy transition does not hinge on one seed's numerics.
- The RL pipeline (init-model -> sft-data -> sft -> `asyncrl rl`) runs on an easier task so that a
  short SFT already copies and RL has a clear signal within a couple of minutes: the sampled
  (temperature 1) reward of the last RL steps beats the first ones, the trainer's mismatch KL to
  the inference logprobs stays small, and rollouts sampled by updated weights (policy versions > 0)
  reach the trainer while the run goes on.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tomli_w

from asyncrl.config import load_config
from asyncrl.config.envs import EnvConfig
from asyncrl.config.sampling import SamplingParams
from asyncrl.config.trainer import SFTConfig
from asyncrl.run_dir import weights_dir
from asyncrl.tools.engine_eval import evaluate
from asyncrl.tools.init_model import init_model
from asyncrl.tools.report import write_report
from asyncrl.tools.sft_export import write_sft_data
from asyncrl.trainer.sft import run_sft
from asyncrl.transport.rollouts import read_batch
from helpers import child_env, free_port

# One letter out of eight: the same copy-the-right-character skill as the demo, learned by a short SFT
# (the copy mechanism appears near step 250 on this model), and few enough tasks for a quick RL signal.
ENV_ARGS = {"min_len": 1, "max_len": 1, "alphabet": "abcdefgh"}
SFT_STEPS = 300
RL_STEPS = 20


# The demo's task, init, SFT settings and stop rule (examples/reverse_text), with less data.
DEMO_ENV_ARGS = {"min_len": 3, "max_len": 5}
DEMO_INIT_STD = 0.06
# The plateau before copying sits near 2.2. Where the copy transition falls depends on the CPU's kernels
# (ATen's AVX2 and AVX-512 code sum in different orders), so the stop must come past the transition, not
# inside it: stopped at a mean of 1.3, seed 0 answered 9 of 64 exactly on AVX2 and 2 of 64 on AVX-512.
COPY_LOSS = 1.0
# Seen, the step where the mean of 25 steps reaches 1.0 (seeds 0, 1): 197, 237 on an AMD EPYC with
# AVX-512 BF16; 316, 384 there with ATEN_CPU_CAPABILITY=avx2 (which reproduces an AVX2-only machine's
# steps exactly); 227, 365 with MKL_CBWR=COMPATIBLE (another fp32 matmul order).
COPY_CAP = 500
EVAL_TASKS = 256  # one whole answer moves the exact-match rate by 0.4%, not by 1.6% as on 64 tasks


def sft_config(tmp_path: Path, data: Path, *, steps: int, batch_size: int, warmup: int, **extra) -> SFTConfig:
    """SFT of tmp_path/base on `data` into tmp_path/sft at lr 1e-2, publishing the last step; `extra`
    adds keys (seed, stop)."""
    return load_config(
        SFTConfig,
        {
            "model": {"path": str(tmp_path / "base")},
            "run_dir": str(tmp_path / "sft"),
            "max_steps": steps,
            "seq_len": 512,
            "optim": {"lr": 1e-2},
            "schedule": {"warmup_steps": warmup},
            "data": {"path": str(data), "batch_size": batch_size},
            "publish": {"interval": steps, "keep_last": 1},
            "peak_flops": 1e11,
            **extra,
        },
    )


def sft(tmp_path: Path) -> Path:
    init_model("tiny-moe", tmp_path / "base", seed=0)
    data = tmp_path / "sft.jsonl"
    write_sft_data("reverse-text", 1000, data, corrupt_prob=0.5, seed=0, env_args=ENV_ARGS)
    cfg = sft_config(tmp_path, data, steps=SFT_STEPS, batch_size=16, warmup=5)
    run_sft(cfg)
    return weights_dir(cfg.run_dir, SFT_STEPS)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("seed", [0, 1])
def test_demo_sft_reaches_copying(tmp_path, seed):
    init_model("tiny-moe", tmp_path / "base", seed=seed, std=DEMO_INIT_STD)
    data = tmp_path / "sft.jsonl"
    write_sft_data("reverse-text", 32 * COPY_CAP, data, corrupt_prob=0.3, seed=seed, env_args=DEMO_ENV_ARGS)
    cfg = sft_config(
        tmp_path,
        data,
        steps=COPY_CAP,
        batch_size=32,
        warmup=10,
        seed=seed,
        stop={"loss": COPY_LOSS, "window": 25},
    )
    records = run_sft(cfg)
    losses = [r["loss"] for r in records]
    assert len(records) < COPY_CAP, f"no copy transition in {COPY_CAP} steps: {losses[::25]}"

    # The greedy answers are reversals, not letters of the prompt in some order: a model that only
    # learned which letters to use would rarely get a whole 3-5 letter answer right.
    env = EnvConfig(name="reverse-text", args=DEMO_ENV_ARGS)
    result = evaluate(
        str(weights_dir(cfg.run_dir, len(records))),
        env,
        num=EVAL_TASKS,
        sampling=SamplingParams(temperature=0.0, max_tokens=10),
    )
    # Seen (reward, exact; seeds 0, 1) in the three settings of COPY_CAP: 0.878, 0.570 and 0.865, 0.559;
    # 0.800, 0.414 and 0.765, 0.332; 0.866, 0.535 and 0.781, 0.355. Models that do not copy scored at
    # most 0.69 and 0.125: on or leaving the plateau (mean loss >= 1.45), or stuck near 1.0 repeating the
    # answer's first letters (AVX2 with 12,800 rows of data). The right letters in random order would
    # score exact ~0.07.
    assert result.reward > 0.7 and result.rewards["exact"] > 0.15, result


def rl_config(model: Path, run_dir: Path) -> dict:
    return {
        "model": str(model),
        "run_dir": str(run_dir),
        "max_steps": RL_STEPS,
        "seq_len": 256,
        "deployment": {"base_port": free_port()},
        "inference": {"max_num_seqs": 64, "device": "cpu"},
        "orchestrator": {
            "batch_size": 128,  # 16 prompts per step: with 8 letters, fewer make the step mean noisy
            "group_size": 8,
            "max_async_steps": 1,
            "max_off_policy_steps": 1,
            "sampling": {"temperature": 1.0, "max_tokens": 4},
            "envs": {"envs": [{"name": "reverse-text", "args": ENV_ARGS, "max_total_tokens": 256}]},
        },
        "trainer": {"model": {"device": "cpu"}, "optim": {"lr": 2e-3}, "peak_flops": 1e11},  # the engine's
    }


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_demo_reward_rises_with_small_mismatch_and_in_flight_updates(tmp_path):
    model = sft(tmp_path)
    run_dir = tmp_path / "rl"
    config = tmp_path / "rl.toml"
    config.write_text(tomli_w.dumps(rl_config(model, run_dir)))
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl", "rl", "@", str(config)],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    orch = sorted((r for r in records if r.get("role") == "orchestrator"), key=lambda r: r["step"])
    trainer = [r for r in records if r.get("role") != "orchestrator"]
    assert [r["step"] for r in orch] == list(range(1, RL_STEPS + 1))
    assert len(trainer) == RL_STEPS
    rewards = [r["reward/mean"] for r in orch if "reward/mean" in r]  # steps where episodes finished
    first, last = float(np.mean(rewards[:6])), float(np.mean(rewards[-6:]))
    assert last > first + 0.03, f"reward did not rise: {[round(x, 3) for x in rewards]}"

    # Tokens sampled by the weights being trained (v_{n-1}), over a context those weights computed,
    # measure the engine mismatch alone: an fp32 engine and trainer agree to rounding. (Before the
    # split looked at the context, a completion spanning an update put 0.054 here in one CI run.)
    current = [r["mismatch_kl_current"] for r in trainer]
    assert max(current) < 1e-6, current  # seen: <= 1e-12 (0 where a batch holds no such token)
    # Older tokens (max_off_policy_steps = 1) add an optimizer step of drift: bounded, not zero.
    kl = [r["mismatch_kl"] for r in trainer]
    assert float(np.mean(kl)) < 0.1 and max(kl) < 0.5, kl  # seen: means 0.009-0.033, max 0.065

    versions = set()
    for step in range(1, RL_STEPS + 1):
        batch = read_batch(run_dir, step, timeout_s=1.0)
        versions |= {int(v) for s in batch.samples for v in s.policy_versions[s.loss_mask]}
    assert max(versions) > 0 and max(versions) >= RL_STEPS // 2, sorted(versions)

    # `asyncrl report` on the real run: every figure drawn; the one panel without data is the
    # held-out eval's, since this run sets no [orchestrator.eval], and the page says so
    index = write_report(run_dir)
    for name in ("reward", "mismatch", "dropped", "inference", "trainer", "prefix_cache", "staleness"):
        assert (index.parent / f"{name}.png").stat().st_size > 5000, name
    page = index.read_text()
    assert page.count("not logged") == 1, page
    assert "held-out eval: not logged (no eval lines: set [orchestrator.eval] interval)" in page
