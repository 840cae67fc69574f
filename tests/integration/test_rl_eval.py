"""`asyncrl rl` with evals during training, on a tiny model: eval lines every 2 versions and the
final one, the best version kept from pruning and named at the end, and the report's curve."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.tools.init_model import init_model
from asyncrl.tools.report import write_report
from asyncrl.transport.weights import read_keep_set, stable_steps
from helpers import child_env, free_port

pytestmark = pytest.mark.slow  # an RL run of 4 steps, three processes: 1-2 min on 2 busy cores


def test_rl_with_an_eval_every_2_steps_writes_the_lines_keeps_the_best_and_plots_them(tmp_path):
    init_model("tiny-moe", tmp_path / "model", seed=0)
    run_dir = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "asyncrl",
        "rl",
        "--model",
        str(tmp_path / "model"),
        "--run-dir",
        str(run_dir),
        "--max-steps",
        "4",
        "--seq-len",
        "256",
        "--deployment.base-port",
        str(free_port()),
        "--orchestrator.envs.envs",
        '[{name = "reverse-text", max_total_tokens = 256}]',
        "--orchestrator.batch_size",
        "8",
        "--orchestrator.group_size",
        "4",
        "--orchestrator.sampling.max_tokens",
        "8",
        "--inference.device",
        "cpu",
        "--orchestrator.eval",
        '{interval = 2, k = 2, num_tasks = 4, keep_best = "eval/reverse-text/reward"}',
        "--trainer.publish.keep_last",
        "1",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, env=child_env(), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in lines if r["role"] == "eval"]
    assert [(r["step"], r["version"]) for r in evals] == [(0, 0), (2, 2), (4, 4)]
    assert all(r["eval/episodes"] == 4 * 3 and 0 <= r["eval/reverse-text/pass@2"] <= 1 for r in evals)
    assert re.search(r"\[orchestrator\] eval v4 \| reverse-text: reward \d\.\d{3} pass@1 ", done.stdout)

    best = max(evals, key=lambda r: (r["eval/reverse-text/reward"], -r["version"]))
    said = re.search(
        r"asyncrl rl: best version by eval/reverse-text/reward: v(\d+) \(([\d.]+)\), (\S+)", done.stdout
    )
    assert said, done.stdout[-2000:]
    assert int(said[1]) == best["version"] and float(said[2]) == pytest.approx(
        best["eval/reverse-text/reward"], abs=1e-4
    )
    assert (Path(said[3]) / "config.json").is_file()  # kept although publish.keep_last = 1
    assert stable_steps(run_dir) == sorted({4} | ({best["version"]} - {0}))
    assert set(read_keep_set(run_dir)) == {best["version"]} - {0}

    page = write_report(run_dir).read_text()
    assert '<img src="reward.png"' in page and "held-out eval: not logged" not in page
