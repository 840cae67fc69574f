"""The RL step: on-policy identities, router replay, learning, and skipping non-finite steps."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from asyncrl.config.trainer import LossConfig, TrustRegionLossConfig
from asyncrl.distributed import DistInfo
from asyncrl.trainer.loss import rl_loss
from asyncrl.trainer.packing import build_micro_batch, pack_samples
from asyncrl.trainer.step import StepRunner
from asyncrl.trainer.synthetic import synthetic_batch
from asyncrl.wire import RolloutSample

# Qwen3-MoE, and GLM-5 (MLA + sparse attention + grouped sigmoid router + a dense first layer)
PRESETS = ["tiny-moe", "tiny-glm5"]


def _rl(cfg: LossConfig | None = None):
    cfg = cfg or TrustRegionLossConfig()
    return lambda inputs, n: rl_loss(inputs, cfg, n)


@pytest.mark.parametrize("preset", PRESETS)
def test_on_policy_batch_has_ratio_one_and_zero_mismatch(tiny_model, make_step_runner, preset):
    model = tiny_model(preset)
    batch = synthetic_batch(model, step=1, num_samples=6, prompt_len=8, completion_len=16, seed=1)
    runner = make_step_runner(model)
    for s in batch.samples:  # unpacked: the same computation the "engine" did
        mb = build_micro_batch([s], replay=True)
        with torch.no_grad():
            lp, _ = runner.forward_micro_batch(mb)
        torch.testing.assert_close(lp[mb.loss_mask], mb.inference_logprobs[mb.loss_mask], rtol=0, atol=1e-6)
    result = runner.step(pack_samples(batch.samples, 64, replay=True), _rl(), trained_version=0)
    assert not result.skipped
    assert abs(result.mismatch_kl) < 1e-10 and result.masked_fraction == 0.0
    assert result.staleness_mean == 0.0 and result.staleness_max == 0  # sampled at v0, trained at step 1 (v0)
    assert result.num_loss_tokens == sum(int(s.loss_mask[1:].sum()) for s in batch.samples)


def _foreign_routing(model, sample: RolloutSample, seed: int) -> np.ndarray:
    """Expert choices unlike the model's own: a random pair of distinct experts per token and layer."""
    rng = np.random.default_rng(seed)
    a = model.args
    T = sample.num_tokens
    scores = rng.random((T, a.num_hidden_layers, a.num_experts))
    return np.argsort(scores, axis=-1)[..., : a.num_experts_per_tok].astype(np.uint8)


@pytest.mark.parametrize("preset", PRESETS)
def test_router_replay_reproduces_logprobs_recorded_under_foreign_routing(
    tiny_model, make_step_runner, preset
):
    model = tiny_model(preset)
    base = synthetic_batch(model, step=1, num_samples=1, prompt_len=6, completion_len=20, seed=2).samples[0]
    routed = _foreign_routing(model, base, seed=0)
    # What an inference engine that routed this way recorded: the same weights, forced routing.
    ids = torch.from_numpy(base.token_ids.astype(np.int64))[None]
    with torch.no_grad():
        out = model(ids, routed_experts=torch.from_numpy(routed.astype(np.int64))[None])
        recorded = torch.log_softmax(out.logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None]).squeeze(1)
    sample = dataclasses.replace(
        base,
        routed_experts=routed,
        inference_logprobs=np.concatenate([[0.0], recorded.numpy()]).astype(np.float32),
    )
    runner = make_step_runner(model)
    results = {}
    for replay in (True, False):
        mb = build_micro_batch([sample], replay=replay)
        with torch.no_grad():
            lp, _ = runner.forward_micro_batch(mb)
        results[replay] = (lp[mb.loss_mask] - mb.inference_logprobs[mb.loss_mask]).abs().max().item()
    assert results[True] < 1e-5
    assert results[False] > 1e-3  # the trainer's own routing gives different logprobs


@pytest.mark.parametrize(("preset", "ratio_cap"), [(PRESETS[0], float("inf"))] + [(p, 2.0) for p in PRESETS])
def test_fixed_batch_is_learnable(tiny_model, make_step_runner, preset, ratio_cap):
    """Twelve steps on one batch go far off-policy. Uncapped, the loss keeps falling with the
    growing ratios; with the default cap the loss saturates at -C * A per token (and rises again as
    the trust region masks tokens), but the positive-advantage tokens are learned just the same."""
    model = tiny_model(preset)
    batch = synthetic_batch(model, step=1, num_samples=8, prompt_len=8, completion_len=16, seed=3)
    mbs = pack_samples(batch.samples, 256, replay=True)
    runner = make_step_runner(model, lr=3e-3)

    def positive_logprob() -> float:
        with torch.no_grad():
            vals = [runner.forward_micro_batch(mb)[0][mb.loss_mask & (mb.advantages > 0)] for mb in mbs]
        return torch.cat(vals).mean().item()

    before = positive_logprob()
    loss_fn = _rl(TrustRegionLossConfig(ratio_cap=ratio_cap))
    losses = [runner.step(mbs, loss_fn, trained_version=0).loss for _ in range(12)]
    after = positive_logprob()
    if ratio_cap == float("inf"):
        assert losses[-1] < losses[0] - 0.5, losses
    else:
        assert min(losses) < losses[0] - 0.5, losses
    assert after > before + 0.5, (before, after)


def test_non_finite_loss_skips_the_step_and_keeps_weights(tiny_model, make_step_runner):
    model = tiny_model()
    batch = synthetic_batch(model, step=1, num_samples=4, prompt_len=8, completion_len=8, seed=4)
    bad = dataclasses.replace(
        batch.samples[0], advantages=np.full(batch.samples[0].num_tokens, np.nan, np.float32)
    )
    runner = make_step_runner(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = runner.step(pack_samples([bad, *batch.samples[1:]], 256, replay=True), _rl(), trained_version=0)
    assert result.skipped
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not runner.optimizer.state  # AdamW moments were never touched
    ok = runner.step(pack_samples(batch.samples, 256, replay=True), _rl(), trained_version=1)
    assert not ok.skipped and any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_batch_without_loss_tokens_is_skipped(tiny_model, make_step_runner):
    model = tiny_model()
    s = synthetic_batch(model, step=1, num_samples=1, prompt_len=8, completion_len=8, seed=5).samples[0]
    empty = dataclasses.replace(s, loss_mask=np.zeros(s.num_tokens, bool))
    result = make_step_runner(model).step(pack_samples([empty], 64, replay=True), _rl(), trained_version=0)
    assert result.skipped and result.num_loss_tokens == 0


def test_step_runner_at_world_size_above_one_needs_a_parallel_state(tiny_model):
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    two = DistInfo(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="needs a ParallelState"):
        StepRunner(model, optimizer, scheduler, two, max_grad_norm=1.0, chunk_size=64)
