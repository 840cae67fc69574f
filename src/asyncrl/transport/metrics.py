"""RUN/metrics.jsonl: the one writer of per-step metrics, shared by the trainer and the orchestrator.

Every line is one JSON object that starts with three keys, then the role's own metrics:

    {"role": "trainer", "step": 3, "time": 1718000000.1, "loss": 0.41, ...}
    {"role": "orchestrator", "step": 3, "time": 1718000000.3, "reward/mean": 0.52, ...}
    {"role": "eval", "step": 10, "time": 1718000009.7, "version": 10, "eval/reverse-text/pass@4": 0.61, ...}

`role` names what wrote it (the trainer, the orchestrator, or the orchestrator's evals during
training), `step` the trainer step (the batch) it describes, or for an eval the policy version it
evaluated (v_n is trainer step n's), and `time` the Unix time of the write. Several processes
append to the same file: each line goes out in one `O_APPEND` write, so concurrent lines never
interleave.

A process that keeps a step's metrics in its checkpoint (the trainer, the orchestrator) may be killed
after the checkpoint and before the line; on resume it calls `write_missing`, which writes the line
only if the file has none for that step and role.

On resume, `drop_metrics_after` removes the lines of steps that will be redone (a trainer that
restarts from an older checkpoint retrains them), so every step of a role appears once. It
rewrites the file (temp + rename) and must run while no process appends: `asyncrl rl --resume`
calls it before starting any child.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from asyncrl.run_dir import metrics_file

__all__ = ["HEADER_KEYS", "MetricsWriter", "Role", "append_jsonl", "drop_metrics_after", "read_metrics"]

Role = Literal["trainer", "orchestrator", "eval"]
HEADER_KEYS = ("role", "step", "time")  # the writer's own keys, first in every line


class MetricsWriter:
    """Appends one `{"role", "step", "time", **metrics}` line per call to `RUN/metrics.jsonl`."""

    def __init__(self, run_dir: str | Path, role: Role) -> None:
        self.path = metrics_file(run_dir)
        self.role = role
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Append the line of `step` and return it. `metrics` may not set role or time itself."""
        clash = [k for k in ("role", "time") if k in metrics]
        if clash or metrics.get("step", step) != step:
            raise ValueError(
                f"metrics of step {step} set {clash or ['step']}: the writer owns role, step, time"
            )
        record = {"role": self.role, "step": step, "time": time.time()}
        record |= {k: v for k, v in metrics.items() if k not in HEADER_KEYS}
        append_jsonl(self.path, record)
        return record

    def write_missing(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any] | None:
        """Write the line of `step` unless the file already holds one of this role; the line, or None."""
        if any(r.get("step") == step for r in read_metrics(self.path.parent, self.role)):
            return None
        return self.write(step, metrics)


def append_jsonl(path: str | Path, record: Mapping[str, Any]) -> None:
    """Append one JSON line with a single O_APPEND write, so concurrent writers never interleave."""
    data = (json.dumps(dict(record)) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def read_metrics(run_dir: str | Path, role: Role | None = None) -> list[dict[str, Any]]:
    """The lines of RUN/metrics.jsonl (of one role if given), in file order; [] if there is no file.

    A torn last line (a writer killed mid-write on a filesystem without atomic appends) is skipped.
    """
    path = metrics_file(run_dir)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if role is None or record.get("role") == role:
            records.append(record)
    return records


def drop_metrics_after(run_dir: str | Path, last_step: Mapping[Role, int]) -> int:
    """Remove the lines of role r with step > last_step[r]; returns how many were removed.

    Roles not in `last_step` keep every line. Atomic (temp + rename); not safe while another
    process appends to the file.
    """
    path = metrics_file(run_dir)
    if not path.is_file():
        return 0
    kept, removed = [], 0
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            removed += 1  # a torn line of a killed writer
            continue
        limit = last_step.get(record.get("role"))  # type: ignore[arg-type]
        if limit is not None and int(record.get("step", 0)) > limit:
            removed += 1
        else:
            kept.append(line + "\n")
    if removed:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)
    return removed
