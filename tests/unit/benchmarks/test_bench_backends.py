"""benchmarks/bench_backends.py's tables: a server that failed in a later round keeps the runs it
completed, and the cells it has no run for show as "-"; ratios are the median of the rounds' ratios.
Its rounds, with stand-in servers: restarted or interleaved, and a server that dies."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import re
import sys
from pathlib import Path

import pytest

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


def _fake_rounds(monkeypatch, interleave: bool, dies: str | None = None):
    """run_rounds with stand-in servers: the events in order, and what it returned."""
    events = []

    @contextlib.contextmanager
    def serve(kind, model, args, log):
        events.append(("start", kind))
        yield bench_backends.Server(url=f"http://{kind}", pgid=len(events))
        events.append(("stop", kind))

    async def throughput(kind, server, requests, concurrency, others=()):
        if kind == dies and any(e[0] == "run" and e[1] == kind for e in events):
            raise RuntimeError(f"{kind} server exited")
        events.append(("run", kind, requests[0].max_tokens == 128, requests[0].cache_salt, len(others)))
        return bench_backends.Rate(tok_s=100.0, cpu_ms_per_token=1.0, others_cpu_share=0.01 * len(others))

    monkeypatch.setattr(bench_backends, "serve", serve)
    monkeypatch.setattr(bench_backends, "throughput", throughput)
    args = argparse.Namespace(
        repeats=2, interleave=interleave, requests=2, fixed_tokens=128, max_tokens=64, concurrency=4
    )
    runs, failed = bench_backends.run_rounds(args, ["a", "b"], Path("model"), Path("logs"))
    return events, runs, failed


def test_rounds_restart_each_server_and_run_its_workloads_together(monkeypatch):
    events, runs, failed = _fake_rounds(monkeypatch, interleave=False)
    one_round = [
        ("start", "a"),
        "a fixed",
        "a mixed",
        ("stop", "a"),
        ("start", "b"),
        "b fixed",
        "b mixed",
        ("stop", "b"),
    ]
    shown = [e if e[0] != "run" else f"{e[1]} {'fixed' if e[2] else 'mixed'}" for e in events]
    assert shown == one_round * 2
    assert all(e[4] == 0 for e in events if e[0] == "run")  # no other server up during a run
    salts = [e[3] for e in events if e[0] == "run"]
    assert salts[:4] == ["bench-0-0", "bench-1-0"] * 2 and salts[4:] == ["bench-0-1", "bench-1-1"] * 2
    assert failed == {} and {k: len(v) for k, v in runs.items()} == {
        ("a", "fixed"): 2,
        ("a", "mixed"): 2,
        ("b", "fixed"): 2,
        ("b", "mixed"): 2,
    }


def test_interleaved_rounds_keep_the_servers_up_and_alternate_their_order(monkeypatch):
    events, runs, failed = _fake_rounds(monkeypatch, interleave=True)
    shown = [e if e[0] != "run" else f"{e[1]} {'fixed' if e[2] else 'mixed'}" for e in events]
    assert shown == [
        ("start", "a"), ("start", "b"),
        "a fixed", "b fixed", "a mixed", "b mixed",  # round 1
        "b fixed", "a fixed", "b mixed", "a mixed",  # round 2, reversed
        ("stop", "a"), ("stop", "b"),
    ]  # fmt: skip
    assert all(e[4] == 1 for e in events if e[0] == "run")  # the other server measured as idle
    assert runs["a", "fixed"][0].others_cpu_share == 0.01 and failed == {}


def test_an_interleaved_server_that_dies_runs_no_more_and_is_stopped(monkeypatch):
    events, runs, failed = _fake_rounds(monkeypatch, interleave=True, dies="b")
    assert list(failed) == ["b"] and failed["b"].startswith("round 1 of 2: b server exited")
    shown = [e if e[0] != "run" else f"{e[1]} {'fixed' if e[2] else 'mixed'} {e[4]}" for e in events]
    assert shown == [
        ("start", "a"), ("start", "b"),
        "a fixed 1", "b fixed 1", "a mixed 1",  # b dies on its mixed run
        ("stop", "b"),
        "a fixed 0", "a mixed 0",  # round 2: a alone, no idle server left
        ("stop", "a"),
    ]  # fmt: skip
    assert len(runs["a", "fixed"]) == 2 and len(runs["b", "fixed"]) == 1 and ("b", "mixed") not in runs


def test_four_rounds_or_more_show_the_middle_half_of_the_ratios():
    args = argparse.Namespace(fixed_tokens=128, max_tokens=256)
    rate = {
        ("embedded", "fixed"): [1000.0] * 4,
        ("embedded-bf16", "fixed"): [1200.0, 800.0, 1400.0, 1000.0],  # ratios 1.2, 0.8, 1.4, 1.0
    }
    _, _, fixed, _ = bench_backends._rate_table(args, ["embedded", "embedded-bf16"], rate, "tok/s")
    assert fixed.split("|")[-2] == " 1.10x (0.85-1.35) "
    assert bench_backends._ratio([1.2, 0.8, 1.4]) == "1.20x"  # three rounds: the median alone


def test_servers_are_checked_and_the_baseline_runs_once():
    kinds = bench_backends.server_kinds
    assert kinds("embedded,embedded-bf16", None) == ["embedded", "embedded-bf16"]
    assert kinds("embedded, embedded-bf16", "/old/src") == [
        "embedded",
        "embedded-bf16",
        "baseline",
        "baseline-bf16",
    ]
    # named in --backends and added by --baseline-src: each baseline server still runs once
    assert kinds("embedded,baseline-bf16,baseline", "/old/src") == ["embedded", "baseline-bf16", "baseline"]
    for backends, src, message in [
        ("embedded,embeded-bf16", None, "unknown server(s) embeded-bf16"),
        ("embedded,vllm,embedded", None, "names embedded more than once"),
        ("embedded,baseline", None, "need --baseline-src"),
    ]:
        with pytest.raises(SystemExit, match=re.escape(message)):
            kinds(backends, src)
