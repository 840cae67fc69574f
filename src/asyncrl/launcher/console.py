"""What `asyncrl rl` shows while it runs, and the feed of the metric sinks.

Every child's full output goes to RUN/logs/<name>.log (the supervisor writes it). On the console:

- `PlainConsole` (stdout is not a terminal: CI, `> log`): the lines of each child that match its
  echo prefixes, one per line, as they come: the orchestrator's and the trainer's step lines, and
  the orchestrator's fill status while a batch fills.
- `LiveConsole` (stdout is a terminal): one compact status line, rewritten in place,

      step 3/20 | reward 0.520 | mismatch KL 0.0012 | stale 0.40 | eval v2 pass@1 0.310 | gen 1234 tok/s | ...

  built from RUN/metrics.jsonl (the held-out pass@1 of the latest eval during training, averaged
  over its envs), with the fill status appended while a batch fills. Only the
  children's warnings and errors (and fill hints) are printed, above the status line.

Both tail RUN/metrics.jsonl on every supervisor tick and hand each new line to the sinks.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from asyncrl.run_dir import metrics_file
from asyncrl.transport.sinks import Sinks

__all__ = ["Console", "LiveConsole", "MetricsTail", "PlainConsole", "RunStatus", "is_important"]

_IMPORTANT = re.compile(
    r"\b(WARNING|ERROR|CRITICAL|Traceback|SKIPPED|\w*(Warning|Error|Exception))\b|^asyncrl\b"
)
_FILL = "[orchestrator] filling "


def is_important(line: str) -> bool:
    """A child's line that the live console prints: a warning, an error, or a skipped step."""
    return bool(_IMPORTANT.search(line))


class MetricsTail:
    """Reads the lines appended to RUN/metrics.jsonl since the last call (from its size at start)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0
        self._partial = b""

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        records = []
        for line in lines:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line is one atomic write; a bad one is not ours to stop the run for
        return records


class RunStatus:
    """The latest trainer and orchestrator metrics and fill status, rendered as one line."""

    def __init__(self, max_steps: int) -> None:
        self.max_steps = max_steps
        self.trainer: dict[str, Any] = {}
        self.orchestrator: dict[str, Any] = {}
        self.eval: dict[str, Any] = {}
        self.fill: str | None = None
        self.started = time.monotonic()

    def update(self, record: dict[str, Any]) -> None:
        if record.get("role") == "trainer":
            self.trainer = record
        elif record.get("role") == "orchestrator":
            self.orchestrator = record
            self.fill = None  # a batch was written: the fill status it had is over
        elif record.get("role") == "eval":
            self.eval = record

    def render(self, width: int = 200) -> str:
        t, o = self.trainer, self.orchestrator
        parts = [f"step {t.get('step', 0)}/{self.max_steps}"]
        for label, value, fmt in (
            ("reward", o.get("reward/mean"), ".3f"),
            ("mismatch KL", t.get("mismatch_kl"), ".2g"),
            ("stale", o.get("staleness/mean"), ".2f"),
        ):
            if isinstance(value, int | float):
                parts.append(f"{label} {value:{fmt}}")
        pass1 = [v for k, v in self.eval.items() if k.startswith("eval/") and k.endswith("/pass@1")]
        if pass1:
            parts.append(f"eval v{self.eval['version']} pass@1 {sum(pass1) / len(pass1):.3f}")
        if isinstance(o.get("inference/tokens_per_s"), int | float):
            parts.append(f"gen {o['inference/tokens_per_s']:.0f} tok/s")
        if isinstance(t.get("tokens_per_s"), int | float):
            parts.append(f"train {t['tokens_per_s']:.0f} tok/s")
        if self.fill:
            parts.append(self.fill)
        parts.append(_duration(time.monotonic() - self.started))
        line = " | ".join(parts)
        return line if len(line) <= width else line[: max(width - 1, 0)] + "…"


def _duration(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class Console:
    """Tails metrics.jsonl into the sinks; subclasses decide what reaches the terminal."""

    def __init__(
        self, run_dir: str | Path | None = None, sinks: Sinks | None = None, stream: TextIO | None = None
    ) -> None:
        """`run_dir` None: no metrics to tail (a supervisor of processes that write none)."""
        self.tail = MetricsTail(metrics_file(run_dir)) if run_dir is not None else None
        self.sinks = sinks or Sinks()
        self._stream = stream
        self._lock = threading.Lock()  # child lines arrive on the supervisor's reader threads

    @property
    def stream(self) -> TextIO:
        return self._stream or sys.stdout  # looked up late: tests and callers may swap sys.stdout

    def child_line(self, name: str, echo_prefixes: tuple[str, ...], line: str) -> None:
        """One line of child `name`'s output (already written to its log)."""

    def tick(self) -> None:
        """Called by the supervisor every poll: feed new metrics lines to the sinks."""
        for record in self.tail.read() if self.tail is not None else []:
            self.sinks.log(record)
            self.on_record(record)

    def on_record(self, record: dict[str, Any]) -> None:
        pass

    def message(self, text: str) -> None:
        """A message of the launcher itself (a restart, a failure): to stderr, on its own lines."""
        print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        self.tick()
        self.sinks.close()


class PlainConsole(Console):
    """One line per echoed child line, as they come (prefixed with the child's name)."""

    def child_line(self, name: str, echo_prefixes: tuple[str, ...], line: str) -> None:
        if echo_prefixes and line.startswith(echo_prefixes):
            text = line.rstrip() if line.startswith("[") else f"[{name}] {line.rstrip()}"
            with self._lock:
                print(text, file=self.stream, flush=True)


class LiveConsole(Console):
    """One status line rewritten in place; warnings and errors of the children printed above it."""

    def __init__(
        self,
        run_dir: str | Path,
        max_steps: int,
        sinks: Sinks | None = None,
        stream: TextIO | None = None,
    ) -> None:
        super().__init__(run_dir, sinks, stream)
        self.status = RunStatus(max_steps)
        self._hints: set[str] = set()

    def child_line(self, name: str, echo_prefixes: tuple[str, ...], line: str) -> None:
        line = line.rstrip()
        if line.startswith(_FILL):
            fill, _, hint = line.removeprefix(_FILL).partition(" | hint: ")
            self.status.fill = "filling " + fill.split(" | reward")[0]
            if hint and hint not in self._hints:
                self._hints.add(hint)
                self._print_above(f"[{name}] hint: {hint}")
            return
        if is_important(line):
            self._print_above(line if line.startswith("[") else f"[{name}] {line}")

    def on_record(self, record: dict[str, Any]) -> None:
        self.status.update(record)

    def tick(self) -> None:
        super().tick()
        self._draw()

    def message(self, text: str) -> None:
        with self._lock:
            self._clear()
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        super().close()
        with self._lock:
            self.stream.write("\n")
            self.stream.flush()

    def _print_above(self, text: str) -> None:
        with self._lock:
            self._clear()
            self.stream.write(text + "\n")
            self._write_status()

    def _draw(self) -> None:
        with self._lock:
            self._clear()
            self._write_status()

    def _clear(self) -> None:
        self.stream.write("\r\x1b[K")

    def _write_status(self) -> None:
        self.stream.write(self.status.render(shutil.get_terminal_size().columns - 1))
        self.stream.flush()
