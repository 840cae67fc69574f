"""`asyncrl sft` end to end on a tiny model: the loss falls and the output is a publishable model."""

from __future__ import annotations

import json

import pytest

from asyncrl.config import load_config
from asyncrl.config.trainer import SFTConfig
from asyncrl.run_dir import weights_dir
from asyncrl.tools.init_model import init_model
from asyncrl.trainer.sft import run_sft
from asyncrl.transport import stable_steps


def test_sft_cli_entry_point(tmp_path):
    from asyncrl.launcher.cli import main

    model_dir = tmp_path / "model"
    init_model("tiny-dense", model_dir, seed=0)
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    toml = tmp_path / "sft.toml"
    toml.write_text(f'run_dir = "{tmp_path / "run"}"\nmax_steps = 2\n[model]\npath = "{model_dir}"\n')
    assert (
        main(["sft", "@", str(toml), "--data.path", str(data), "--seq-len", "32", "--peak-flops", "1e11"])
        == 0
    )
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    assert stable_steps(tmp_path / "run") == [1, 2]


def _config(tmp_path, model_dir, data, **keys) -> SFTConfig:
    """SFT of `model_dir` on `data` at lr 3e-3, rows of 96 tokens, batches of 4; `keys` add the rest."""
    base = {
        "model": {"path": str(model_dir)},
        "run_dir": str(tmp_path / "run"),
        "seq_len": 96,
        "optim": {"lr": 3e-3},
        "data": {"path": str(data), "batch_size": 4},
        "peak_flops": 1e11,
    }
    return load_config(SFTConfig, base | keys)


def test_sft_learns_a_fixed_answer_and_publishes(tmp_path):
    model_dir = tmp_path / "model"
    init_model("tiny-dense", model_dir, seed=0)
    rows = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "ok!"}]}
        for i in range(4)
    ]
    rows += [{"prompt": f"say {i}:", "completion": "ok!"} for i in range(4)]
    data = tmp_path / "sft.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = _config(
        tmp_path, model_dir, data, max_steps=12, checkpoint={"interval": 6}, publish={"keep_last": 1}
    )
    records = run_sft(cfg)
    assert [r["step"] for r in records] == list(range(1, 13))
    assert records[-1]["loss"] < 0.5 * records[0]["loss"], [r["loss"] for r in records]
    assert "mismatch_kl" not in records[0] and "staleness_mean" not in records[0]
    assert stable_steps(cfg.run_dir) == [12]
    assert (weights_dir(cfg.run_dir, 12) / "chat_template.jinja").is_file()
    assert sorted(p.name for p in (cfg.run_dir / "checkpoints").iterdir()) == ["step_12", "step_6"]


def test_sft_stops_at_the_loss_threshold_and_publishes_that_step(tmp_path):
    model_dir = tmp_path / "model"
    init_model("tiny-dense", model_dir, seed=0)
    rows = [{"prompt": f"say {i}:", "completion": "ok!"} for i in range(8)]
    data = tmp_path / "sft.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = _config(
        tmp_path,
        model_dir,
        data,
        max_steps=60,
        checkpoint={"interval": 100},
        publish={"interval": 100, "keep_last": 1},
        stop={"loss": 1.0, "window": 3},
    )
    records = run_sft(cfg)
    losses = [r["loss"] for r in records]
    last = len(records)
    assert 3 <= last < 60, losses
    assert sum(losses[-3:]) / 3 <= 1.0, losses
    assert all(sum(losses[i - 3 : i]) / 3 > 1.0 for i in range(3, last)), losses  # the first such step
    assert stable_steps(cfg.run_dir) == [last]  # published although neither interval nor max_steps
    assert [p.name for p in (cfg.run_dir / "checkpoints").iterdir()] == [f"step_{last}"]


def test_sft_stop_threshold_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="stop.loss"):
        load_config(
            SFTConfig,
            {"model": {"path": str(tmp_path)}, "max_steps": 1, "data": {"path": "x"}, "stop": {"loss": 0}},
        )
