"""Synthetic rollout batches scored by a model itself, for tests, benchmarks and smoke runs.

Token ids are random bytes; each sample's inference logprobs and routed experts are computed by
`model` on that sample alone (teacher forcing), exactly as an fp32 inference engine sharing
`asyncrl.model` would have reported them. So a trainer holding the same weights is on-policy.

    batch = synthetic_batch(model, step=1, num_samples=8, prompt_len=16, completion_len=16)
"""

from __future__ import annotations

import numpy as np
import torch

from asyncrl.model import Transformer
from asyncrl.trainer.logprobs import token_logprobs_reference
from asyncrl.wire import RolloutBatch, RolloutSample

__all__ = ["score_tokens", "synthetic_batch"]


@torch.no_grad()
def score_tokens(
    model: Transformer, token_ids: np.ndarray, temperature: float
) -> tuple[np.ndarray, np.ndarray | None]:
    """Logprob of each token given its prefix ([T] f32, 0 at position 0) and routing [T, L, K] uint8."""
    ids_BT = torch.from_numpy(token_ids.astype(np.int64)).unsqueeze(0)
    out = model(ids_BT, return_routing=model.args.is_moe, compute_logits=False)
    h_TD = out.hidden_states[0, :-1]
    temp_T = torch.full((h_TD.shape[0],), temperature)
    lp = token_logprobs_reference(h_TD, model.lm_head.weight, ids_BT[0, 1:], temp_T)
    logprobs = np.concatenate([[0.0], lp.numpy()]).astype(np.float32)
    routed = out.routed_experts[0].numpy().astype(np.uint8) if out.routed_experts is not None else None
    return logprobs, routed


def synthetic_batch(
    model: Transformer,
    *,
    step: int,
    num_samples: int,
    prompt_len: int,
    completion_len: int,
    seed: int = 0,
    temperature: float = 1.0,
    version: int | None = None,
    with_routing: bool = True,
) -> RolloutBatch:
    """`num_samples` sequences; advantages alternate +1 / -1 by sample; tokens sampled at `version`."""
    rng = np.random.default_rng(seed)
    version = step - 1 if version is None else version
    samples = []
    for i in range(num_samples):
        n = prompt_len + completion_len - int(rng.integers(0, max(1, completion_len // 2)))
        token_ids = rng.integers(0, 256, size=n).astype(np.int32)
        logprobs, routed = score_tokens(model, token_ids, temperature)
        loss_mask = np.arange(n) >= prompt_len
        advantage = 1.0 if i % 2 == 0 else -1.0
        samples.append(
            RolloutSample(
                token_ids=token_ids,
                loss_mask=loss_mask,
                inference_logprobs=np.where(loss_mask, logprobs, 0.0).astype(np.float32),
                advantages=np.where(loss_mask, advantage, 0.0).astype(np.float32),
                temperatures=np.full(n, temperature, np.float32),
                policy_versions=np.full(n, version, np.int32),
                routed_experts=routed if with_routing else None,
                reward=max(advantage, 0.0),
                env="synthetic",
                episode_id=f"syn-{step}-{i}",
            )
        )
    return RolloutBatch(step=step, samples=samples)
