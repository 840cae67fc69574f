"""benchmarks/gpu_check.py at toy size on CPU: every section runs, its numbers hang together and
its correctness checks pass, so the GPU check does not rot between the runs on a lent GPU.

A second run hides pydantic, as the GPU machine's image does: the engine sections must fail with
that reason while the model-level sections still run.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from asyncrl.model import preset_args
from asyncrl.model.compute import cpu_upcast
from asyncrl.trainer.metrics import flops_per_token

ROOT = Path(__file__).resolve().parents[3]
SECTIONS = ["env", "matmul_peak", "trainer", "fp8", "exact", "weights", "decode"]

# Runs the script with pydantic unimportable (a meta-path finder that refuses it), like the GPU image.
WITHOUT_PYDANTIC = """
import runpy, sys
class NoPydantic:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("pydantic", "pydantic_core"):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)")
sys.meta_path.insert(0, NoPydantic())
sys.argv = sys.argv[1:]
sys.path.insert(0, "benchmarks")
runpy.run_path("benchmarks/gpu_check.py", run_name="__main__")
"""


def _run(args: list[str], *, hide_pydantic: bool = False) -> subprocess.CompletedProcess:
    script = ["-c", WITHOUT_PYDANTIC] if hide_pydantic else []
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, *script, "benchmarks/gpu_check.py", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict, Path]:
    out = tmp_path_factory.mktemp("gpu_check")
    proc = _run(["--device", "cpu", "--tiny", "--out", str(out)])
    return proc, json.loads((out / "gpu_check.json").read_text()), out


def test_tiny_run_has_every_section_and_passes(tiny_run):
    proc, result, out = tiny_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert result["passed"] is True
    assert list(result["sections"]) == SECTIONS
    for name, sec in result["sections"].items():
        assert sec["status"] == "ok", (name, sec)
        assert all(c["passed"] is not False for c in sec.get("checks", {}).values()), (name, sec)
    table = (out / "gpu_check.md").read_text()
    assert all(f"| {name} | status | ok" in table for name in SECTIONS)


def test_tiny_run_numbers_are_consistent(tiny_run):
    _, result, _ = tiny_run
    sec = {name: s["metrics"] for name, s in result["sections"].items()}
    checks = {name: s.get("checks", {}) for name, s in result["sections"].items()}
    assert sec["env"]["engine_imports"] == "yes"
    peak = sec["matmul_peak"]["tflops"]
    assert peak > 0 and math.isfinite(peak)

    train = sec["trainer"]
    # the script's own FLOP count (it cannot import the trainer's without pydantic) is the trainer's
    assert train["flops_per_token"] == pytest.approx(
        flops_per_token(preset_args("tiny-moe"), train["mean_context"])
    )
    assert train["tokens_per_s"] == pytest.approx(train["tokens_per_step"] / train["step_s"])
    assert train["achieved_tflops"] == pytest.approx(train["flops_per_token"] * train["tokens_per_s"] / 1e12)
    assert train["mfu"] == pytest.approx(train["achieved_tflops"] / peak)
    assert train["grouped_gemm"] is False  # CPU: the per-expert loop
    for name in ("grouped_mm_matches_loop", "grouped_mm_empty_expert"):
        assert checks["trainer"][name]["skipped"].startswith("no CUDA device")

    fp8 = checks["fp8"]
    assert 0.01 < fp8["emulated_vs_fp32"]["value"] < 0.05  # really quantized, and not too coarse
    assert fp8["scaled_mm_vs_emulated"]["passed"] is None
    assert fp8["scaled_mm_vs_emulated"]["skipped"] == "no CUDA device"
    assert sec["fp8"]["backend"] == "emulated"
    assert sec["fp8"]["128x256x256 bf16_tflops"] > 0

    for c in (64, 256):
        assert sec["decode"][f"c{c} decode_tok_s"] > 0
        assert sec["decode"][f"c{c} decode_steps"] >= 1
        assert sec["decode"][f"c{c} truncated"] is False
        assert checks["decode"][f"c{c}_all_tokens_generated"]["passed"] is True

    exact = checks["exact"]
    assert exact["tokens_scored"]["value"] == 4 * 8
    assert exact["mismatch_kl_mean"]["value"] < 1e-6
    assert sec["exact"]["routing_agreement_min_layer"] == 1.0


def test_write_takes_gpu_runs_only(tiny_run, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import main

    _, result, out = tiny_run
    target = tmp_path / "BENCHMARKS.md"
    target.write_text("# Benchmarks\n\n## Model\n\nkept\n")
    with pytest.raises(SystemExit, match="--write records a full-size GPU run"):
        main(["--from-json", str(out / "gpu_check.json"), "--write", "--benchmarks", str(target)])
    assert "## GPU check" not in target.read_text()

    result["meta"].update(mode="full", device="cuda")  # as a GPU run's JSON reads
    gpu_json = tmp_path / "gpu.json"
    gpu_json.write_text(json.dumps(result))
    assert main(["--from-json", str(gpu_json), "--write", "--benchmarks", str(target)]) == 0
    text = target.read_text()
    assert "## Model\n\nkept" in text
    assert "## GPU check" in text and "| exact | check: mismatch_kl_mean | PASS" in text


def test_without_pydantic_engine_sections_fail_and_the_others_run(tmp_path):
    proc = _run(["--device", "cpu", "--tiny", "--out", str(tmp_path)], hide_pydantic=True)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = result["sections"]
    assert result["passed"] is False
    assert "pydantic" in sections["env"]["metrics"]["engine_imports"]
    assert [sections[name]["status"] for name in ("matmul_peak", "trainer", "fp8")] == ["ok"] * 3
    for name in ("decode", "exact"):
        assert sections[name]["status"] == "error"
        assert "pydantic" in sections[name]["error"]


def test_grouped_vs_loop_check_runs_on_cpu(monkeypatch):
    """The check's plumbing (shapes, an empty expert, the gradient comparison) runs here. On a CPU
    with native bf16 one side is torch's grouped GEMM in bf16, which gives the per-expert loop's
    bf16 results exactly (measured on AVX-512 BF16); without, the default side computes in fp32."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_check import TINY
    from gpu_check_sections import Ctx, _grouped_vs_loop

    ctx = Ctx(device=torch.device("cpu"), sizes=TINY, seed=0, deadline=time.perf_counter() + 60)
    check = _grouped_vs_loop(ctx, [30, 0, 10, 15, 5, 20, 12, 8])
    assert check.passed is True
    if cpu_upcast(torch.zeros(1, dtype=torch.bfloat16)):
        # no bf16 kernels on this CPU: the default path computes in fp32 (asyncrl.model.compute)
        # while the hooked loop multiplies in bf16, so the two differ by bf16 rounding only
        assert 0.0 < check.value < 1e-2
    else:
        assert check.value == 0.0
