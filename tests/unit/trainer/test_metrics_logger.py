"""The trainer's step log: plain lines off a terminal, a progress bar on one, every line to the sinks."""

from __future__ import annotations

import json
import sys

from asyncrl.trainer.metrics import MetricsLogger
from asyncrl.transport.sinks import Sinks


class _Recorder:
    name = "recorder"

    def __init__(self) -> None:
        self.records: list = []
        self.closed = False

    def log(self, record) -> None:
        self.records.append(dict(record))

    def close(self) -> None:
        self.closed = True


def test_plain_lines_when_stdout_is_not_a_terminal(tmp_path, capsys):
    sink = _Recorder()
    logger = MetricsLogger(tmp_path, enabled=True, sinks=Sinks([sink]), total_steps=3)
    logger.log({"step": 1, "loss": 0.5, "tokens_per_s": 1000.0})
    logger.log({"step": 2, "loss": 0.25, "skipped": True})
    logger.close()
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        "step 1 | loss 0.5 | tokens_per_s 1000",
        "step 2 | SKIPPED (non-finite loss or grad, or no loss tokens; weights unchanged) | loss 0.25",
    ]
    assert "\r" not in out + err  # no bar
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in sink.records] == [1, 2] and sink.records == lines
    assert sink.records[0]["role"] == "trainer" and sink.closed


def test_progress_bar_with_eta_on_a_terminal(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    logger = MetricsLogger(tmp_path, enabled=True, total_steps=4, start_step=1)
    logger.log({"step": 2, "loss": 0.5, "tokens_per_s": 1234.0})
    logger.log({"step": 3, "loss": 0.25, "skipped": True})
    logger.close()
    out, err = capsys.readouterr()
    assert out.splitlines() == [  # only the skipped step gets a line of its own
        "step 3 | SKIPPED (non-finite loss or grad, or no loss tokens; weights unchanged) | loss 0.25"
    ]
    assert "3/4" in err and "loss=0.25" in err and "<" in err  # steps done, postfix, ETA
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def test_disabled_rank_writes_and_prints_nothing(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, enabled=False, total_steps=3)
    logger.log({"step": 1, "loss": 0.5})
    logger.close()
    assert capsys.readouterr() == ("", "") and not (tmp_path / "metrics.jsonl").exists()


def test_log_missing_logs_a_step_only_if_the_file_lacks_it(tmp_path, capsys):
    sink = _Recorder()
    MetricsLogger(tmp_path, enabled=True).log({"step": 1, "loss": 0.5})
    logger = MetricsLogger(tmp_path, enabled=True, sinks=Sinks([sink]), total_steps=3, start_step=2)
    logger.log_missing({"step": 1, "loss": 0.75})
    logger.log_missing({"step": 2, "loss": 0.25})
    logger.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in lines] == [(1, 0.5), (2, 0.25)]
    assert sink.records == lines[1:]
    assert capsys.readouterr().out.splitlines() == ["step 1 | loss 0.5", "step 2 | loss 0.25"]
