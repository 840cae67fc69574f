"""benchmarks/bench_backends.py's tables: a server that failed in a later round keeps the runs it
completed, and the cells it has no run for show as "-"; ratios are the median of the rounds' ratios."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

PATH = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_backends.py"
spec = importlib.util.spec_from_file_location("bench_backends", PATH)
bench_backends = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = bench_backends  # its dataclasses look their module up
spec.loader.exec_module(bench_backends)


def test_a_missing_workload_shows_as_a_dash_and_the_rest_of_the_row_stays():
    args = argparse.Namespace(fixed_tokens=128, max_tokens=256)
    kinds = ["embedded", "embedded-bf16", "vllm"]
    rate = {
        ("embedded", "fixed"): [1000.0],
        ("embedded", "mixed"): [900.0],
        ("embedded-bf16", "fixed"): [1500.0],
        ("embedded-bf16", "mixed"): [1200.0],
        ("vllm", "fixed"): [800.0],  # vLLM died during its mixed-length round
    }
    header, _, fixed, mixed = bench_backends._rate_table(args, kinds, rate, "tok/s")
    assert header.startswith("| workload | embedded tok/s | embedded-bf16 tok/s | vllm tok/s |")
    assert "embedded / vllm |" in header and "embedded-bf16 / embedded |" in header
    assert fixed.split("|")[2:5] == [" 1000 ", " 1500 ", " 800 "]
    assert " 1.25x |" in fixed and " 1.50x |" in fixed  # embedded / vllm, embedded-bf16 / embedded
    assert mixed.split("|")[2:5] == [" 900 ", " 1200 ", " - "]
    cells = mixed.split("|")[5:-1]
    assert cells == [" - ", " - ", " 1.33x "]  # against vLLM: none; bf16 / fp32 still there


def test_ratios_pair_the_rounds_and_a_failed_server_its_first_rounds():
    # bf16 / fp32 per round: 0.9, 1.2 (a round in which the machine was slow for fp32), 1.1; its
    # median 1.1, where the ratio of the servers' medians would be 900 / 900.
    args = argparse.Namespace(fixed_tokens=128, max_tokens=256)
    kinds = ["embedded", "embedded-bf16", "vllm"]
    rate = {
        ("embedded", "fixed"): [1000.0, 500.0, 900.0],
        ("embedded-bf16", "fixed"): [900.0, 600.0, 990.0],
        ("vllm", "fixed"): [800.0, 600.0],  # failed in round 3
    }
    _, _, fixed, _ = bench_backends._rate_table(args, kinds, rate, "tok/s")
    assert fixed.split("|")[2:5] == [" 900 ", " 900 ", " 700 "]  # medians of each server's rounds
    embedded_vllm, bf16_vllm, bf16_fp32 = fixed.split("|")[5:-1]
    assert bf16_fp32 == " 1.10x "
    assert embedded_vllm == " 1.04x "  # median of 1000 / 800 and 500 / 600; round 3 unpaired
    assert bf16_vllm == " 1.06x "  # median of 900 / 800 and 600 / 600
