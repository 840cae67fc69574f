"""`asyncrl report`: every figure from a metrics.jsonl with the trainer's and orchestrator's key names."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from safetensors.numpy import save_file

from asyncrl.launcher import cli
from asyncrl.run_dir import batch_dir
from asyncrl.tools.report import ReportError, load_eval, load_metrics, token_staleness, write_report
from asyncrl.transport.rollouts import LEGACY_BATCH_FILE, write_batch
from asyncrl.wire import RolloutBatch, RolloutSample, encode_batch

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ALL_FIGURES = ("reward", "eval", "mismatch", "dropped", "inference", "trainer", "prefix_cache", "staleness")


def trainer_record(step: int) -> dict:
    """A trainer line as asyncrl.trainer.session writes it (no `role` key)."""
    return {
        "step": step,
        "skipped": False,
        "loss": 0.01,
        "grad_norm": 0.3,
        "lr": 1e-4,
        "num_tokens": 340,
        "num_loss_tokens": 64,
        "masked_fraction": 0.0,
        "mismatch_kl": 1e-3 / step,
        "entropy": 5.5,
        "staleness_mean": 1.0,
        "staleness_max": 1,
        "mean_context": 20.0,
        "seconds": 3.0,
        "mismatch_kl_max": 0.01,
        "mismatch_ratio_outside": 0.0,
        "mismatch_kl_current": 0.0,
        "mismatch_kl_stale": 1e-3 / step,
        "mismatch_tokens_stale_fraction": 1.0 if step > 1 else 0.0,
        "routing_agreement": 0.9,
        "routing_agreement/layer_0": 0.95,
        "routing_agreement/layer_1": 0.85,
        "tokens_per_s": 40.0 + step,
        "mfu": 0.01,
        "peak_memory_gb": 0.4,
        "num_samples": 8,
        "reward_mean": 0.05,
        "wait_s": 0.001,
    }


def orchestrator_record(step: int) -> dict:
    """A line as asyncrl.orchestrator.metrics (and main's pause time) writes it."""
    return {
        "role": "orchestrator",
        "step": step,
        "time": 1.7e9 + step,
        "policy_version": step - 1,
        "reward/mean": 0.1 * step,
        "reward/batch_mean": 0.1 * step,
        "reward/reverse-text": 0.1 * step,
        "episode/tokens": 40.0,
        "episode/completion_tokens": 8.0,
        "episode/turns": 1.0,
        "episode/tool_errors": 0.0,
        "episode/failed": 0.0,
        "batch/samples": 8,
        "batch/tokens": 340,
        "staleness/mean": 1.0,
        "staleness/max": 1,
        "dropped/groups_stale_queue": 0,
        "dropped/groups_stale_in_flight": step // 2,
        "dropped/groups_zero_advantage": 3 * step,
        "episodes/failed_total": 0,
        "episodes/retried_total": 1,
        "inference/idle_s": 0.5,
        "orchestrator/step_s": 2.0,
        "inference/prefix_hit_rate": 0.4,
        "inference/tokens_per_s": 20.0,
        "inference/requests": 28.0,
        "inference/pause_s": 0.05,
    }


def eval_record(version: int) -> dict:
    """A line of an eval during training, as asyncrl.orchestrator.eval_metrics writes it."""
    return {
        "role": "eval",
        "step": version,
        "time": 1.7e9 + version,
        "version": version,
        "eval/episodes": 80,
        "eval/seconds": 2.0,
        "eval/tokens_on_version": 1.0,
        "eval/reverse-text/reward": 0.5 + 0.05 * version,
        "eval/reverse-text/pass@1": 0.1 * version,
        "eval/reverse-text/pass@4": 0.2 * version,
        "eval/reverse-text/greedy_reward": 0.6,
        "eval/reverse-text/length": 5.0,
        "eval/reverse-text/failed": 0.0,
        "eval/reverse-text/truncated": 0.0,
    }


def sample(versions: list[int]) -> RolloutSample:
    n = 2 + len(versions)
    return RolloutSample(
        token_ids=np.arange(n, dtype=np.int32),
        loss_mask=np.array([0, 0] + [1] * len(versions), bool),
        inference_logprobs=np.zeros(n, np.float32),
        advantages=np.zeros(n, np.float32),
        temperatures=np.ones(n, np.float32),
        policy_versions=np.array([0, 0, *versions], np.int32),
    )


def write_run(run_dir, steps: int = 4, roles: tuple[str, ...] = ("trainer", "orchestrator", "eval")) -> None:
    run_dir.mkdir(parents=True)
    lines = [eval_record(0)] if "eval" in roles else []
    for step in range(1, steps + 1):
        if "orchestrator" in roles:
            lines.append(orchestrator_record(step))
        if "trainer" in roles:
            lines.append(trainer_record(step))
        if "eval" in roles and step % 2 == 0:
            lines.append(eval_record(step))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_report_draws_every_figure_from_the_logged_key_names(tmp_path, capsys):
    run = tmp_path / "run"
    write_run(run)
    # batch 3 (trained from v2): two tokens of v2 (staleness 0), three of v1 (staleness 1)
    write_batch(run, RolloutBatch(step=3, samples=[sample([2, 2]), sample([1, 1, 1])]))
    evals = tmp_path / "eval.jsonl"
    evals.write_text(
        "".join(
            json.dumps({"label": label, "temperature": t, "reward": r, "num_tasks": 16}) + "\n"
            for label, t, r in (("sft", 0.0, 0.5), ("sft", 1.0, 0.4), ("rl", 0.0, 0.7), ("rl", 1.0, 0.6))
        )
    )
    assert cli.main(["report", str(run), "--eval", str(evals)]) == 0
    out_dir = run / "report"
    assert capsys.readouterr().out.strip() == f"report: {out_dir / 'index.html'}"
    page = (out_dir / "index.html").read_text()
    for name in ALL_FIGURES:
        png = (out_dir / f"{name}.png").read_bytes()
        assert png.startswith(PNG_MAGIC) and len(png) > 5000, name
        assert f'<img src="{name}.png"' in page
    assert "Not in this run" not in page and "not logged" not in page
    assert "over 5 tokens of 1 of the 1 batches" in page
    assert "first / last 1 steps</td><td>0.100 / 0.400" in page
    assert "held-out reverse-text pass@1, v0 / v4</td><td>0.000 / 0.400" in page


def test_the_held_out_evals_are_drawn_next_to_the_training_reward(tmp_path):
    from asyncrl.tools.report import load_metrics
    from asyncrl.tools.report_figures import FIGURES

    run = tmp_path / "run"
    write_run(run)
    records = load_metrics(run / "metrics.jsonl")
    _, held_out = FIGURES[0].panels
    curves = {line.label: (steps, values) for line, steps, values in held_out.curves(records)}
    assert list(curves) == ["sampled reward", "pass@1", "greedy reward", "pass@4"]
    assert curves["pass@4"] == ([0, 2, 4], [0.0, 0.4, 0.8])  # at the versions evaluated
    write_run(tmp_path / "no-eval", roles=("trainer", "orchestrator"))
    page = write_report(tmp_path / "no-eval").read_text()
    assert "held-out eval: not logged (no eval lines: set [orchestrator.eval] interval)" in page


def test_token_staleness_counts_each_loss_token_once(tmp_path):
    write_batch(tmp_path, RolloutBatch(step=3, samples=[sample([2, 2]), sample([1, 1, 0])]), num_parts=2)
    # batch 4 in the single-file layout of runs written before batches were split per rank
    arrays, meta = encode_batch(RolloutBatch(step=4, samples=[sample([3])]))
    batch_dir(tmp_path, 4).mkdir(parents=True)
    save_file(arrays, str(batch_dir(tmp_path, 4) / LEGACY_BATCH_FILE), metadata=meta)
    staleness, num_read, num_present = token_staleness(tmp_path)
    assert sorted(staleness.tolist()) == [0, 0, 0, 1, 1, 2]
    assert (num_read, num_present) == (2, 2)


def test_figures_of_absent_metrics_are_named_not_drawn(tmp_path):
    run = tmp_path / "run"
    write_run(run, roles=("trainer",))  # no orchestrator lines, no rollouts, no eval file
    page = write_report(run).read_text()
    drawn = set(re.findall(r'<img src="(\w+)\.png"', page))
    assert drawn == {"mismatch", "trainer"}
    assert sorted(p.stem for p in (run / "report").glob("*.png")) == ["mismatch", "trainer"]
    assert "reward: not logged (orchestrator:reward/mean, orchestrator:reward/batch_mean)" in page
    assert "prefix-cache hit rate: not logged (orchestrator:inference/prefix_hit_rate)" in page
    assert "no eval file (pass --eval FILE" in page
    assert "no batches under rollouts/ and no orchestrator &#x27;staleness/max&#x27;" in page


def test_a_panel_without_data_is_named_under_the_figure_that_has_the_rest(tmp_path):
    run = tmp_path / "run"
    write_run(run)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        r.pop("inference/pause_s", None)
        r.pop("mismatch_kl_current", None)
        r["role"] = r.get("role", "trainer")  # the unified format: every line carries its role
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    page = write_report(run).read_text()
    assert '<img src="inference.png"' in page
    assert "Missing: weight-update pause per step: not logged (orchestrator:inference/pause_s)." in page
    assert (
        '<img src="mismatch.png"' in page and "Missing" not in page.split("mismatch.png")[1].split("<h2>")[0]
    )


def test_load_metrics_skips_a_partial_last_line_and_names_a_broken_one(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "loss": 0.1}) + "\n" + '{"step": 2, "lo')
    assert load_metrics(path) == {"trainer": [{"step": 1, "loss": 0.1}]}
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ReportError, match=r"metrics.jsonl:2: not a JSON line"):
        load_metrics(path)
    path.write_text('{"role": "orchestrator"}\n')
    with pytest.raises(ReportError, match=r"metrics.jsonl:1: expected a JSON object with an integer 'step'"):
        load_metrics(path)
    with pytest.raises(ReportError, match="no metrics file"):
        load_metrics(tmp_path / "absent.jsonl")


def test_load_eval_names_the_missing_key(tmp_path):
    path = tmp_path / "eval.jsonl"
    path.write_text(json.dumps({"label": "rl", "reward": 0.5}) + "\n")
    with pytest.raises(ReportError, match=r"eval.jsonl:1: expected keys 'label', 'temperature' and 'reward'"):
        load_eval(path)
    path.write_text(json.dumps({"label": "rl", "temperature": 0.0, "reward": "high"}) + "\n")
    with pytest.raises(ReportError, match="must be finite numbers"):
        load_eval(path)


def test_cli_report_on_a_directory_without_metrics_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["report", str(tmp_path)])
    assert e.value.code == 2
    assert "no metrics file" in capsys.readouterr().err
