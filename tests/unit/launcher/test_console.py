"""The `asyncrl rl` console: plain lines off a terminal, one live status line on one; both feed sinks."""

from __future__ import annotations

import io
import sys

from asyncrl.launcher.console import LiveConsole, MetricsTail, PlainConsole, RunStatus, is_important
from asyncrl.launcher.supervisor import ChildSpec, Supervisor
from asyncrl.transport.metrics import MetricsWriter
from asyncrl.transport.sinks import Sinks

_FILL = (
    "[orchestrator] filling step 3: 4/16 samples | 9 groups in 20s: 8 zero advantage, 0 stale, "
    "0 with failed episodes | reward mean 0.000 | hint: every episode scored 0.000, so no signal"
)


class _Recorder:
    name = "recorder"

    def __init__(self) -> None:
        self.records: list = []

    def log(self, record) -> None:
        self.records.append(dict(record))

    def close(self) -> None:
        pass


def _writes_metrics(run_dir) -> str:
    return (
        "from asyncrl.transport.metrics import MetricsWriter;"
        f"MetricsWriter({str(run_dir)!r}, 'trainer').write(1, {{'loss': 0.5}});"
        "print('step 1 | loss 0.5'); print('chatter'); import time; time.sleep(0.3)"
    )


def test_plain_console_prints_echoed_lines_only_and_feeds_the_sinks(tmp_path, capsys):
    run_dir, sink = tmp_path / "run", _Recorder()
    MetricsWriter(run_dir, "trainer").write(0, {"loss": 9.0})  # from before the launch: not re-sent
    console = PlainConsole(run_dir, Sinks([sink]))
    sup = Supervisor(
        [
            ChildSpec(
                name="orchestrator",
                argv=[sys.executable, "-c", f"print({_FILL!r}); print('noise')"],
                log=tmp_path / "o.log",
                echo_prefixes=("[orchestrator]",),
                may_exit_ok=True,
            ),
            ChildSpec(
                name="trainer",
                argv=[sys.executable, "-c", _writes_metrics(run_dir)],
                log=tmp_path / "t.log",
                echo_prefixes=("step ",),
                done_ok=True,
            ),
        ],
        poll_s=0.05,
        console=console,
    )
    assert sup.run() == 0
    out = capsys.readouterr().out
    assert sorted(out.splitlines()) == sorted([_FILL, "[trainer] step 1 | loss 0.5"])
    assert "\r" not in out and "\x1b" not in out
    assert [(r["role"], r["step"], r["loss"]) for r in sink.records] == [("trainer", 1, 0.5)]
    assert "chatter" in (tmp_path / "t.log").read_text()


def test_live_console_keeps_one_status_line_and_prints_warnings_and_hints_above(tmp_path):
    run_dir, stream = tmp_path / "run", io.StringIO()
    console = LiveConsole(run_dir, max_steps=5, stream=stream)
    MetricsWriter(run_dir, "orchestrator").write(
        2, {"reward/mean": 0.5, "staleness/mean": 0.5, "inference/tokens_per_s": 1234.4}
    )
    MetricsWriter(run_dir, "trainer").write(2, {"mismatch_kl": 0.00123, "tokens_per_s": 99.0})
    console.tick()
    console.child_line("trainer", ("step ",), "step 2 | loss 0.1\n")  # in metrics.jsonl: not printed
    console.child_line("orchestrator", ("[orchestrator]",), _FILL + "\n")
    console.child_line("orchestrator", ("[orchestrator]",), _FILL + "\n")  # same hint: once
    console.child_line("inference-0", (), "2024-01-01 asyncrl.inference WARNING slow step\n")
    status = console.status.render()
    assert status.startswith(
        "step 2/5 | reward 0.500 | mismatch KL 0.0012 | stale 0.50 | gen 1234 tok/s | train 99 tok/s | "
        "filling step 3: 4/16 samples | 9 groups in 20s: 8 zero advantage, 0 stale, 0 with failed episodes | "
    )
    console.close()
    printed = [line.split("\r\x1b[K")[-1] for line in stream.getvalue().split("\n")]
    assert printed[:2] == [
        "[orchestrator] hint: every episode scored 0.000, so no signal",
        "[inference-0] 2024-01-01 asyncrl.inference WARNING slow step",
    ]
    assert printed[2].startswith("step 2/5 | reward 0.500") and printed[3] == ""
    assert "loss 0.1" not in stream.getvalue()


def test_a_new_batch_clears_the_fill_status_and_the_line_fits_the_width():
    status = RunStatus(max_steps=3)
    status.fill = "filling step 1: 0/8 samples"
    status.update({"role": "orchestrator", "step": 1, "reward/mean": 0.25})
    assert status.fill is None
    assert status.render().startswith("step 0/3 | reward 0.250 | 0m")
    assert len(status.render(width=12)) == 12 and status.render(width=12).endswith("…")


def test_the_status_line_shows_the_latest_held_out_pass_at_1():
    status = RunStatus(max_steps=20)
    status.update({"role": "orchestrator", "step": 11, "reward/mean": 0.5})
    status.update(
        {
            "role": "eval",
            "step": 10,
            "version": 10,
            "eval/a/pass@1": 0.2,
            "eval/b/pass@1": 0.4,
            "eval/a/pass@4": 0.9,
        }
    )
    assert "| reward 0.500 | eval v10 pass@1 0.300 |" in status.render()


def test_tail_reads_whole_lines_only(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    assert tail.read() == []
    path.write_bytes(b'{"role": "trainer", "step": 1}\n{"role": "tra')
    assert tail.read() == [{"role": "trainer", "step": 1}]
    with path.open("ab") as f:
        f.write(b'iner", "step": 2}\n')
    assert tail.read() == [{"role": "trainer", "step": 2}]


def test_important_lines():
    assert is_important("2024 asyncrl.orchestrator WARNING episode e1 failed")
    assert is_important("/x.py:3: UserWarning: router_replay = true but ...")
    assert is_important("Traceback (most recent call last):")
    assert is_important("Exception in ASGI application")
    assert is_important("asyncrl orchestrator: step 1 did not fill")
    assert is_important("step 3 | SKIPPED (non-finite loss)")
    assert not is_important("step 3 | loss 0.5 | mismatch_kl 0.001")
    assert not is_important("INFO:     127.0.0.1 - POST /v1/generate 200 OK")
