"""Turn rollout samples into packed micro-batches, and split a batch across data-parallel ranks.

A micro-batch is one row of at most `seq_len` tokens holding several whole sequences. Position
ids restart at 0 for each sequence, which is how the model keeps them from attending to each
other. Per-token fields are shifted to the *target* convention: position t predicts token t+1,
so row[t] carries token t+1's loss mask, inference logprob, advantage, temperature and version;
the last position of every sequence predicts nothing (loss mask false).

Shape legend: T tokens in the row, L layers, K top_k.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from asyncrl.wire import BatchFormatError, RolloutSample, split_by_tokens

__all__ = ["MicroBatch", "build_micro_batch", "pack_samples", "plan_bins", "shard_samples"]


@dataclass(frozen=True, kw_only=True)
class MicroBatch:
    """One packed row and its target-aligned per-token streams.

    Example: samples of 3 and 2 tokens give position_ids [[0, 1, 2, 0, 1]], seq_ids [0, 0, 0, 1, 1],
    and loss_mask[2] == loss_mask[4] == False (last token of each sequence has no target).
    """

    input_ids: torch.Tensor  # int64 [1, T]
    position_ids: torch.Tensor  # int64 [1, T]
    target_ids: torch.Tensor  # int64 [T], token t+1 (0 where there is none)
    loss_mask: torch.Tensor  # bool [T]
    inference_logprobs: torch.Tensor  # f32 [T]
    advantages: torch.Tensor  # f32 [T]
    temperatures: torch.Tensor  # f32 [T], never 0 (1.0 where there is no target)
    policy_versions: torch.Tensor  # int64 [T]
    # int64 [T]: the oldest weights version among the sampled tokens of the sequence up to the
    # target, each counted as min(its policy version, its KV version): every version whose KV the
    # engine attended over when it sampled the target (a completion that spans a weight update
    # continues on KV computed by the older weights, and a prompt prefilled across an update or
    # taken from the prefix cache can predate the first sampled token)
    context_versions: torch.Tensor
    seq_ids: torch.Tensor  # int64 [T], 0..num_sequences-1
    routed_experts: torch.Tensor | None  # int64 [1, T, L, K], or None when not replaying
    num_sequences: int

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def to(self, device: torch.device | str) -> MicroBatch:
        moved = {
            name: (value.to(device) if isinstance(value, torch.Tensor) else value)
            for name, value in self.__dict__.items()
        }
        return MicroBatch(**moved)


def shard_samples(samples: list[RolloutSample], rank: int, world_size: int) -> list[RolloutSample]:
    """This rank's share: the token-balanced split the orchestrator writes batches in (`split_by_tokens`)."""
    mine = split_by_tokens([s.num_tokens for s in samples], world_size)[rank]
    return [samples[i] for i in mine]


def plan_bins(lengths: list[int], seq_len: int) -> list[list[int]]:
    """First-fit-decreasing bin packing of sequence lengths into rows of at most `seq_len` tokens."""
    for i, n in enumerate(lengths):
        if n > seq_len:
            raise BatchFormatError(
                f"sample {i} has {n} tokens, more than seq_len={seq_len}; raise seq_len "
                "or cap the episode length in the orchestrator"
            )
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(seq_len - lengths[i])
    return bins


def _shifted(values: np.ndarray, fill: float | int | bool) -> np.ndarray:
    """Row t gets values[t + 1]; the last position gets `fill`."""
    out = np.empty_like(values)
    out[:-1] = values[1:]
    out[-1] = fill
    return out


def _context_versions(versions: np.ndarray, kv_versions: np.ndarray | None = None) -> np.ndarray:
    """Running minimum over sampled tokens of min(policy version, KV version); -1 before the first.

    Prompt, env and tool tokens (-1) are skipped; a sample without KV versions (None, or -1 on a
    sampled token) counts the policy version alone.

    Example: versions [-1, -1, 2, 2, 3, -1, 3] -> [-1, -1, 2, 2, 2, 2, 2]; with kv_versions
    [-1, -1, 1, 1, 3, -1, 3] -> [-1, -1, 1, 1, 1, 1, 1].
    """
    versions = versions.astype(np.int64)
    if kv_versions is not None:
        versions = np.where(kv_versions >= 0, np.minimum(versions, kv_versions), versions)
    big = np.iinfo(np.int64).max
    running = np.minimum.accumulate(np.where(versions >= 0, versions, big))
    return np.where(running == big, -1, running)


def build_micro_batch(samples: list[RolloutSample], replay: bool) -> MicroBatch:
    """Concatenate whole samples into one row (see module docstring for the target convention)."""
    cat = np.concatenate
    with_routing = [s.routed_experts is not None for s in samples]
    replay = replay and any(with_routing)
    if replay and not all(with_routing):
        raise BatchFormatError("routed_experts must be present on every sample of a batch or on none")
    routed = None
    if replay:
        routed_TLK = torch.from_numpy(cat([s.routed_experts.astype(np.int64) for s in samples]))  # type: ignore[union-attr]
        routed = routed_TLK.unsqueeze(0)
    return MicroBatch(
        input_ids=torch.from_numpy(cat([s.token_ids for s in samples]).astype(np.int64)).unsqueeze(0),
        position_ids=torch.from_numpy(cat([np.arange(s.num_tokens) for s in samples])).unsqueeze(0),
        target_ids=torch.from_numpy(cat([_shifted(s.token_ids, 0) for s in samples]).astype(np.int64)),
        loss_mask=torch.from_numpy(cat([_shifted(s.loss_mask, False) for s in samples])),
        inference_logprobs=torch.from_numpy(cat([_shifted(s.inference_logprobs, 0.0) for s in samples])),
        advantages=torch.from_numpy(cat([_shifted(s.advantages, 0.0) for s in samples])),
        temperatures=torch.from_numpy(cat([_shifted(s.temperatures, 1.0) for s in samples])),
        policy_versions=torch.from_numpy(
            cat([_shifted(s.policy_versions, 0) for s in samples]).astype(np.int64)
        ),
        context_versions=torch.from_numpy(  # int64 already
            cat([_shifted(_context_versions(s.policy_versions, s.kv_versions), 0) for s in samples])
        ),
        seq_ids=torch.from_numpy(
            cat([np.full(s.num_tokens, i) for i, s in enumerate(samples)]).astype(np.int64)
        ),
        routed_experts=routed,
        num_sequences=len(samples),
    )


def pack_samples(samples: list[RolloutSample], seq_len: int, replay: bool) -> list[MicroBatch]:
    """Pack `samples` into micro-batches of at most `seq_len` tokens each.

    With `replay`, samples with and without routed experts never share a micro-batch: routing is
    per sample (a deadline-cut or aborted episode may have none), and a micro-batch either replays
    routing for every token or routes every token with the trainer's own router.
    """
    kinds = [
        [i for i, s in enumerate(samples) if (s.routed_experts is not None) == routed]
        for routed in (True, False)
    ]
    if not replay:
        kinds = [list(range(len(samples)))]
    out = []
    for idx in kinds:
        bins = plan_bins([samples[i].num_tokens for i in idx], seq_len)
        out += [build_micro_batch([samples[idx[j]] for j in sorted(b)], replay) for b in bins]
    return out
