"""Progress of eval and sft-data: a bar with ETA on a terminal, nothing but the result lines otherwise."""

from __future__ import annotations

import sys

from asyncrl.tools.engine_eval import main as eval_main
from asyncrl.tools.init_model import init_model
from asyncrl.tools.sft_export import main as sft_data_main


def test_sft_data_off_a_terminal_prints_only_its_result_line(tmp_path, capsys):
    out = tmp_path / "sft.jsonl"
    assert sft_data_main(["--env", "reverse-text", "--num", "20", "--out", str(out)]) == 0
    stdout, stderr = capsys.readouterr()
    assert stdout.splitlines() == [f"wrote 20 rows (0 corrupted) from reverse-text to {out}"]
    assert stderr == ""


def test_sft_data_on_a_terminal_shows_a_bar(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    out = tmp_path / "sft.jsonl"
    assert sft_data_main(["--env", "reverse-text", "--num", "20", "--out", str(out)]) == 0
    stdout, stderr = capsys.readouterr()
    assert stdout.splitlines() == [f"wrote 20 rows (0 corrupted) from reverse-text to {out}"]
    assert "sft-data reverse-text" in stderr and "20/20" in stderr and "row/s" in stderr


def test_eval_bar_counts_tasks_on_a_terminal_and_is_silent_otherwise(tmp_path, capsys, monkeypatch):
    init_model("tiny-dense", tmp_path / "model", seed=0)
    argv = ["--model", str(tmp_path / "model"), "--env", "reverse-text", "--num", "3", "--max-tokens", "2"]
    assert eval_main(argv) == 0
    stdout, stderr = capsys.readouterr()
    assert stdout.startswith("eval ") and "\r" not in stdout + stderr and "3/3" not in stderr
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert eval_main(argv) == 0
    stdout, stderr = capsys.readouterr()
    assert stdout.startswith("eval ") and "eval reverse-text (t=0)" in stderr and "3/3" in stderr
