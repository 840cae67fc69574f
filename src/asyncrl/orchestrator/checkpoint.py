"""The orchestrator's checkpoint: what it needs to continue a run, written with every batch.

`rollouts/step_n/` holds the trainer's batch (its parts and manifest) and `orchestrator.safetensors`,
the orchestrator's state right after it cut batch n. Both go into the one directory that
`asyncrl.transport.write_batch` renames into place, so batch n on disk and the state that
follows it always agree: a crash leaves either both or neither.

The state holds the position of the task stream (the next group index and the env-picking RNG),
the groups finished but not yet batched (with their samples), the groups in flight (re-dispatched
on resume from their task, so the prompt is not lost; their partial episodes are), the counters,
the groups of batch n and those dropped since batch n-1 with a reason. Every group has an index,
its position in the task stream; the last three lists let an audit account for every index (see
docs/orchestrator.md, "Checkpoints and resume").

    state = load_latest_state(run_dir)       # None on a fresh run
    dispatcher.restore(state)                # step n+1 next, buffer back, in-flight re-queued
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from asyncrl.orchestrator.buffer import Group
from asyncrl.run_dir import batch_dir
from asyncrl.transport.rollouts import Attachment, batch_steps
from asyncrl.wire import RolloutBatch, decode_batch, encode_batch

__all__ = [
    "STATE_FILE",
    "GroupRef",
    "OrchestratorState",
    "StateFormatError",
    "encode_state",
    "load_latest_state",
    "load_state",
]

STATE_FILE = "orchestrator.safetensors"
_FORMAT = 1


class StateFormatError(ValueError):
    """An orchestrator checkpoint is missing or unreadable; the message names the file."""


@dataclass(frozen=True, kw_only=True)
class GroupRef:
    """A group's identity: its position in the task stream and the env of the mixture it uses."""

    index: int
    env_index: int


@dataclass(kw_only=True)
class OrchestratorState:
    """Everything after batch `step` was cut. Example: `step=3, next_index=9, in_flight=[GroupRef(7, 0)]`."""

    step: int  # the batch written with this state; resume fills step + 1
    next_index: int  # index of the next new group in the task stream
    rng_state: tuple  # random.Random.getstate() of the env picker
    version: int  # policy version the servers held
    counters: dict[str, float | int]
    buffered: list[Group]  # finished, not yet batched
    in_flight: list[GroupRef]  # dispatched, not finished: re-dispatched on resume
    trained: list[int] = field(default_factory=list)  # group indices in batch `step`
    dropped: list[tuple[int, str]] = field(default_factory=list)  # (index, reason) since batch step-1
    metrics: dict[str, Any] = field(default_factory=dict)  # the batch's orchestrator metrics line


def encode_state(state: OrchestratorState) -> Attachment:
    """The state as one safetensors file (buffered samples as arrays, the rest as JSON metadata)."""
    samples = [s for g in state.buffered for s in g.samples]
    arrays, meta = encode_batch(RolloutBatch(step=state.step, samples=samples)) if samples else ({}, {})
    doc = {
        "format": _FORMAT,
        "step": state.step,
        "next_index": state.next_index,
        "rng_state": [state.rng_state[0], list(state.rng_state[1]), state.rng_state[2]],
        "version": state.version,
        "counters": state.counters,
        "groups": [
            {
                "index": g.index,
                "task_id": g.task_id,
                "env": g.env,
                "dispatch_version": g.dispatch_version,
                "num_samples": len(g.samples),
                "rewards": g.rewards,
                "episode_metrics": g.episode_metrics,
            }
            for g in state.buffered
        ],
        "in_flight": [[r.index, r.env_index] for r in state.in_flight],
        "trained": state.trained,
        "dropped": [[i, reason] for i, reason in state.dropped],
        "metrics": state.metrics,
    }
    return {STATE_FILE: (arrays, meta | {"orchestrator_state": json.dumps(doc)})}


def load_state(path: str | os.PathLike) -> OrchestratorState:
    """Read one `orchestrator.safetensors`; StateFormatError names the file if it is not one."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = dict(f.metadata() or {})
            arrays = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (not a mapping)
        doc = json.loads(meta["orchestrator_state"])
    except (SafetensorError, OSError, KeyError, json.JSONDecodeError) as e:
        raise StateFormatError(f"{path}: not an orchestrator checkpoint ({e!r})") from None
    if doc.get("format") != _FORMAT:
        raise StateFormatError(f"{path}: checkpoint format {doc.get('format')}, this version reads {_FORMAT}")
    samples = decode_batch(arrays, meta, where=str(path)).samples if arrays else []
    buffered, at = [], 0
    for g in doc["groups"]:
        n = g.pop("num_samples")
        buffered.append(Group(**g, samples=samples[at : at + n]))
        at += n
    if at != len(samples):
        raise StateFormatError(f"{path}: groups list {at} samples, the file holds {len(samples)}")
    rng = doc["rng_state"]
    return OrchestratorState(
        step=doc["step"],
        next_index=doc["next_index"],
        rng_state=(rng[0], tuple(rng[1]), rng[2]),
        version=doc["version"],
        counters=doc["counters"],
        buffered=buffered,
        in_flight=[GroupRef(index=i, env_index=e) for i, e in doc["in_flight"]],
        trained=list(doc["trained"]),
        dropped=[(int(i), str(reason)) for i, reason in doc["dropped"]],
        metrics=doc["metrics"],
    )


def load_latest_state(run_dir: str | os.PathLike) -> OrchestratorState | None:
    """The state of the newest batch in RUN/rollouts/, or None if no batch was written yet."""
    steps = batch_steps(run_dir)
    if not steps:
        return None
    path = batch_dir(run_dir, steps[-1]) / STATE_FILE
    if not path.is_file():
        raise StateFormatError(
            f"{path} is missing: rollouts/step_{steps[-1]}/ was written without an orchestrator "
            "checkpoint (by another version of asyncrl?), so the run cannot resume from it"
        )
    return load_state(path)
