"""benchmarks/profile_engine.py's batch sweep: the curve interpolation and the workload model that
turns a step-time curve into tokens per second; the prompts that join each compared step
(--prefill-prompts); the router comparison's switch (--compare-router-kernel)."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[3] / "benchmarks" / "profile_engine.py"
spec = importlib.util.spec_from_file_location("profile_engine", PATH)
profile_engine = importlib.util.module_from_spec(spec)
spec.loader.exec_module(profile_engine)


def test_curve_is_interpolated_in_log_batch_and_flat_beyond_the_measured_sizes():
    curve = {1: 10.0, 4: 20.0, 16: 40.0}
    assert profile_engine.curve_ms(curve, 1) == 10.0
    assert profile_engine.curve_ms(curve, 2) == pytest.approx(15.0)  # halfway between 1 and 4 in log
    assert profile_engine.curve_ms(curve, 8) == pytest.approx(30.0)
    assert profile_engine.curve_ms(curve, 64) == 40.0


def test_a_step_that_costs_per_sequence_makes_the_tail_free_and_a_flat_one_does_not():
    lengths = [4, 1, 3]
    # 2 ms per sequence in the step: 2 ms per token, whatever the batch
    linear = {1: 2.0, 2: 4.0, 4: 8.0}
    assert profile_engine.modeled_tok_s(linear, lengths, concurrency=2) == pytest.approx(500.0)
    # 10 ms per step at any batch, 2 in flight: steps run (4, 1), (3, 3), (2, 2), (1, 1): 8 tokens
    # in 4 steps; the fixed-length workload [4, 4] would run 4 full steps
    flat = {1: 10.0, 4: 10.0}
    assert profile_engine.modeled_tok_s(flat, lengths, concurrency=2) == pytest.approx(8 / 0.040)
    assert profile_engine.modeled_tok_s(flat, [4, 4], concurrency=2) == pytest.approx(8 / 0.040)
    assert profile_engine.modeled_tok_s(flat, [4, 1], concurrency=2) == pytest.approx(5 / 0.040)


class _RecordingEngine:
    """Stands in for the engine: records the requests added and the steps taken."""

    def __init__(self) -> None:
        self.added: list[tuple[str, list[int], int]] = []
        self.steps = 0

    def add_request(self, request_id, prompt, options) -> None:
        self.added.append((request_id, prompt, options.max_tokens))

    def step(self) -> int:
        self.steps += 1
        return self.steps


def test_joining_prompts_come_before_each_step_and_match_across_engines():
    fp32, bf16 = _RecordingEngine(), _RecordingEngine()
    steps = [profile_engine.joining(e, 3) for e in (fp32, bf16)]
    for _ in range(2):
        for step in steps:
            step()
    assert fp32.steps == bf16.steps == 2 and len(fp32.added) == 6
    assert fp32.added == bf16.added  # the same prompts, in the same order, for both engines
    assert len({rid for rid, _, _ in fp32.added}) == 6  # every joining request has its own id
    assert all(16 <= len(p) <= 64 and max_tokens == 1 for _, p, max_tokens in fp32.added)
    plain = _RecordingEngine()
    assert profile_engine.joining(plain, 0) == plain.step  # none joining: the engine's own step


def test_the_router_comparison_switches_the_routers_kernel_alone(tmp_path, monkeypatch):
    """--compare-router-kernel: the routers run torch's ops in the "off" windows and the kernel in the
    "on" ones, while the experts and linears keep their kernels in both; all are back on after."""
    from asyncrl.inference import cpu_matmul
    from asyncrl.model import compute
    from asyncrl.model.moe import GroupedExperts, Router
    from asyncrl.tools.init_model import init_model

    if cpu_matmul.load().kernels is None:
        pytest.skip(f"no matmul kernels here: {cpu_matmul.load().note}")
    init_model("tiny-moe", tmp_path / "m", seed=0)
    engines, seen = [], {}
    real_build = profile_engine.build_engine

    def build(*args, **kwargs):
        engines.append(real_build(*args, **kwargs))
        return engines[-1]

    def kernels_on() -> dict[str, set[bool]]:
        on: dict[str, set[bool]] = {}
        for m in engines[0].model.modules():
            if isinstance(m, GroupedExperts | compute.Linear | Router):
                on.setdefault(type(m).__name__, set()).add(m.cpu_kernel is not None)
        return on

    def windows(modes, enter, args):
        for mode in modes:
            enter(mode)()  # one step in this mode
            seen[mode] = kernels_on()
        return dict.fromkeys(modes, 1.0)

    monkeypatch.setattr(profile_engine, "build_engine", build)
    monkeypatch.setattr(profile_engine, "alternating_windows", windows)
    args = argparse.Namespace(concurrency=2, prefill_prompts=0, warm_tokens=2, rounds=1, window=1)
    result = profile_engine.compare(tmp_path / "m", "float32", "router kernel", args)
    assert result == {"off": 1.0, "on": 1.0, "ratio": 1.0}
    assert seen["off"] == {"Router": {False}, "GroupedExperts": {True}, "Linear": {True}}
    assert seen["on"] == {"Router": {True}, "GroupedExperts": {True}, "Linear": {True}}
    assert kernels_on() == seen["on"]
