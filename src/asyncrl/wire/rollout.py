"""Rollout samples and batches: what the orchestrator hands the trainer (torch-free, numpy only).

`encode_batch` turns samples into one safetensors file's arrays (every sample's arrays, concatenated
along tokens) plus the per-sample metadata of its header; `select_encoded` picks some samples out of
such a file reading only their tokens. `split_by_tokens` splits a batch's samples into token-balanced
parts, one per data-parallel trainer rank: the orchestrator writes each part as such a file, and a
trainer that reads the whole batch splits it in memory with the same function.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "BatchFormatError",
    "RolloutBatch",
    "RolloutSample",
    "decode_batch",
    "encode_batch",
    "select_encoded",
    "split_by_tokens",
]

# name -> (dtype, trailing shape after the token axis is fixed); routed_experts is checked separately.
_TOKEN_FIELDS: dict[str, np.dtype] = {
    "token_ids": np.dtype(np.int32),
    "loss_mask": np.dtype(np.bool_),
    "inference_logprobs": np.dtype(np.float32),
    "advantages": np.dtype(np.float32),
    "temperatures": np.dtype(np.float32),
    "policy_versions": np.dtype(np.int32),
}
# Optional columns: present when some sample carries them, with a per-sample flag in the metadata
# (the key below); a sample without one gets filler rows. Batch files written before a column
# existed decode with it None on every sample.
_OPTIONAL_FLAGS = {"routed_experts": "routed", "kv_versions": "kv_versions"}


class BatchFormatError(ValueError):
    """A rollout batch (file or in memory) does not follow the contract; the message names the field."""


@dataclass(frozen=True, kw_only=True)
class RolloutSample:
    """One training sequence, stitched from the exact tokens an episode saw.

    Example (a 5-token prompt and a 3-token completion sampled at version 2)::

        RolloutSample(
            token_ids=np.array([1, 5, 6, 7, 8, 9, 10, 2], np.int32),
            loss_mask=np.array([0, 0, 0, 0, 0, 1, 1, 1], bool),
            inference_logprobs=np.array([0, 0, 0, 0, 0, -0.1, -0.4, -0.2], np.float32),
            advantages=np.array([0, 0, 0, 0, 0, 0.5, 0.5, 0.5], np.float32),
            temperatures=np.ones(8, np.float32),
            policy_versions=np.array([0, 0, 0, 0, 0, 2, 2, 2], np.int32),
            kv_versions=np.array([-1, -1, -1, -1, -1, 1, 1, 1], np.int32),  # prompt prefilled by v1
            reward=1.0, env="reverse-text", episode_id="ep-17",
        )
    """

    token_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # bool [T], true on model-sampled tokens
    inference_logprobs: np.ndarray  # f32 [T], logprob under the sampling distribution (0 where masked)
    advantages: np.ndarray  # f32 [T]
    temperatures: np.ndarray  # f32 [T], sampling temperature of each token
    policy_versions: np.ndarray  # int32 [T], version of the weights that produced each token
    routed_experts: np.ndarray | None = None  # uint8|uint16 [T, layers, top_k]
    # int32 [T] or None (not reported: read as the token's own version). On sampled tokens, the oldest
    # weights version whose KV the engine attended over when sampling it (the prompt's KV can predate
    # the token: a prefill across an update, a prefix-cache hit); -1 on other tokens.
    kv_versions: np.ndarray | None = None
    reward: float = 0.0
    env: str = ""
    episode_id: str = ""
    metrics: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    def validate(self, where: str = "sample") -> None:
        """Raise BatchFormatError naming the field if any array breaks the contract."""
        n = None
        for name, dtype in _TOKEN_FIELDS.items():
            n = _check_token_field(getattr(self, name), name, dtype, n, where)
        if n == 0:
            raise BatchFormatError(f"{where}: field 'token_ids' is empty")
        if self.kv_versions is not None:
            _check_token_field(self.kv_versions, "kv_versions", np.dtype(np.int32), n, where)
        re = self.routed_experts
        if re is not None:
            if re.dtype not in (np.uint8, np.uint16):
                raise BatchFormatError(
                    f"{where}: field 'routed_experts' must be uint8 or uint16, got {re.dtype}"
                )
            if re.ndim != 3 or re.shape[0] != n:
                raise BatchFormatError(
                    f"{where}: field 'routed_experts' must be [T={n}, layers, top_k], got {re.shape}"
                )


def _check_token_field(arr: Any, name: str, dtype: np.dtype, n: int | None, where: str) -> int:
    """Raise BatchFormatError unless `arr` is a 1-D `dtype` array of n tokens (any n if None); its n."""
    if not isinstance(arr, np.ndarray):
        raise BatchFormatError(f"{where}: field '{name}' must be a numpy array, got {type(arr).__name__}")
    if arr.ndim != 1:
        raise BatchFormatError(f"{where}: field '{name}' must be 1-D [T], got shape {arr.shape}")
    if arr.dtype != dtype:
        raise BatchFormatError(f"{where}: field '{name}' must be {dtype}, got {arr.dtype}")
    if n is not None and arr.shape[0] != n:
        raise BatchFormatError(f"{where}: field '{name}' has {arr.shape[0]} tokens but token_ids has {n}")
    return arr.shape[0]


@dataclass(frozen=True, kw_only=True)
class RolloutBatch:
    """All samples for one trainer step. `step` is the step that will consume it (batch n -> v_n)."""

    step: int
    samples: list[RolloutSample]
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.samples)


def encode_batch(batch: RolloutBatch) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Flatten a batch into safetensors-ready arrays plus string metadata.

    Routing is per sample: when some samples carry `routed_experts`, the column holds every
    sample's rows (zeros for a sample without routing) and each sample's metadata says
    `routed: true|false`; the trainer replays routing only for the samples that have it.
    `kv_versions` is per sample the same way (filler -1, metadata `kv_versions: true|false`).
    """
    if not batch.samples:
        raise BatchFormatError(f"batch for step {batch.step} has no samples")
    arrays = {name: np.concatenate([getattr(s, name) for s in batch.samples]) for name in _TOKEN_FIELDS}
    arrays["loss_mask"] = arrays["loss_mask"].astype(
        np.uint8
    )  # safetensors has no numpy bool on all versions
    arrays["lengths"] = np.array([s.num_tokens for s in batch.samples], dtype=np.int64)
    routed = [s for s in batch.samples if s.routed_experts is not None]
    if routed:
        shapes = {s.routed_experts.shape[1:] for s in routed}  # type: ignore[union-attr]
        dtypes = {s.routed_experts.dtype for s in routed}  # type: ignore[union-attr]
        if len(shapes) != 1 or len(dtypes) != 1:
            raise BatchFormatError(f"routed_experts differ across samples: shapes {shapes}, dtypes {dtypes}")
        (row_shape,), (dtype,) = shapes, dtypes
        # A sample without routing gets zero rows in the column and `routed: false` in its metadata.
        arrays["routed_experts"] = np.concatenate(
            [
                s.routed_experts
                if s.routed_experts is not None
                else np.zeros((s.num_tokens, *row_shape), dtype)
                for s in batch.samples
            ]
        )
    if any(s.kv_versions is not None for s in batch.samples):
        arrays["kv_versions"] = np.concatenate(
            [
                s.kv_versions if s.kv_versions is not None else np.full(s.num_tokens, -1, np.int32)
                for s in batch.samples
            ]
        )
    flags = [name for name in _OPTIONAL_FLAGS if name in arrays]
    meta = {
        "step": str(batch.step),
        "samples": json.dumps(
            [
                {"reward": s.reward, "env": s.env, "episode_id": s.episode_id, "metrics": s.metrics}
                | {_OPTIONAL_FLAGS[name]: getattr(s, name) is not None for name in flags}
                for s in batch.samples
            ]
        ),
        "metrics": json.dumps(batch.metrics),
    }
    return arrays, meta


def _require(arrays: dict[str, np.ndarray], name: str, where: str) -> np.ndarray:
    if name not in arrays:
        raise BatchFormatError(f"{where}: missing field '{name}'")
    return arrays[name]


def decode_batch(arrays: dict[str, np.ndarray], meta: dict[str, str], where: str = "batch") -> RolloutBatch:
    """Inverse of `encode_batch`; every problem is reported with `where` (usually the file path)."""
    try:
        step = int(meta["step"])
        sample_meta: list[dict[str, Any]] = json.loads(meta["samples"])
        batch_metrics = json.loads(meta.get("metrics", "{}"))
    except (KeyError, ValueError) as e:
        raise BatchFormatError(f"{where}: bad metadata ({e!r}); expected keys 'step' and 'samples'") from None
    lengths = _require(arrays, "lengths", where)
    if lengths.ndim != 1 or len(lengths) != len(sample_meta):
        raise BatchFormatError(
            f"{where}: field 'lengths' has shape {lengths.shape} but metadata lists {len(sample_meta)} "
            "samples"
        )
    total = int(lengths.sum())
    cols = {}
    for name in [*_TOKEN_FIELDS, *_OPTIONAL_FLAGS]:
        if name in _OPTIONAL_FLAGS and name not in arrays:
            continue
        arr = _require(arrays, name, where)
        if arr.shape[0] != total:
            raise BatchFormatError(
                f"{where}: field '{name}' has {arr.shape[0]} tokens, lengths sum to {total}"
            )
        cols[name] = np.split(arr, np.cumsum(lengths)[:-1])
    samples = []
    for i, m in enumerate(sample_meta):
        fields = {name: parts[i] for name, parts in cols.items()}
        fields["loss_mask"] = fields["loss_mask"].astype(np.bool_)
        for name, flag in _OPTIONAL_FLAGS.items():
            if name in fields and not m.get(flag, True):
                fields[name] = None
        try:
            samples.append(
                RolloutSample(
                    **fields,
                    reward=float(m.get("reward", 0.0)),
                    env=str(m.get("env", "")),
                    episode_id=str(m.get("episode_id", "")),
                    metrics=dict(m.get("metrics", {})),
                )
            )
        except BatchFormatError as e:
            raise BatchFormatError(f"{where}: sample {i}: {e}") from None
    return RolloutBatch(step=step, samples=samples, metrics=batch_metrics)


def select_encoded(
    columns: Mapping[str, Callable[[int, int], np.ndarray]],
    meta: dict[str, str],
    positions: Sequence[int],
    where: str = "batch",
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """`encode_batch`'s arrays and metadata of the samples at `positions` alone, in that order.

    `columns[name](start, stop)` returns rows start:stop of array `name` (a slice of a lazily read
    file), so only the chosen samples' tokens are read. `decode_batch` decodes the result.
    """
    try:
        sample_meta: list[dict[str, Any]] = json.loads(meta["samples"])
    except (KeyError, ValueError) as e:
        raise BatchFormatError(f"{where}: bad metadata ({e!r}); expected key 'samples'") from None
    if "lengths" not in columns:
        raise BatchFormatError(f"{where}: missing field 'lengths'")
    lengths = columns["lengths"](0, len(sample_meta))
    if len(lengths) != len(sample_meta):
        raise BatchFormatError(
            f"{where}: field 'lengths' has {len(lengths)} entries but metadata lists {len(sample_meta)} "
            "samples"
        )
    starts = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    arrays = {"lengths": lengths[list(positions)]}
    for name, rows in columns.items():
        if name != "lengths":
            arrays[name] = np.concatenate([rows(starts[p], starts[p + 1]) for p in positions])
    return arrays, meta | {"samples": json.dumps([sample_meta[p] for p in positions])}


def split_by_tokens(lengths: Sequence[int], num_parts: int) -> list[list[int]]:
    """Sample indices of each of `num_parts` parts, balanced by tokens; each list ascending.

    Longest sample first, each to the part with the fewest tokens so far (ties: the lower part),
    so the plan depends on the lengths alone and every process that computes it agrees.

    Example: lengths [9, 2, 7, 4] in 2 parts -> [[0, 1], [2, 3]] (11 and 11 tokens).
    """
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    loads = [(0, part) for part in range(num_parts)]  # a heap of (tokens so far, part)
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, part = heapq.heappop(loads)
        parts[part].append(i)
        heapq.heappush(loads, (load + int(lengths[i]), part))
    return [sorted(p) for p in parts]
