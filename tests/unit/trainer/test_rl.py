"""The RL trainer's check of a rollout batch against the model, as the batch enters (before packing)."""

from __future__ import annotations

import numpy as np
import pytest

from asyncrl.model import preset_args
from asyncrl.trainer.rl import check_batch_fits_model
from asyncrl.wire import BatchFormatError, RolloutBatch, RolloutSample

MOE = preset_args("tiny-moe")  # vocab 260, 4 layers, 8 experts, top-2
WHERE = "outputs/run/rollouts/step_1"


def _sample(token_ids: list[int], routed: np.ndarray | None = None) -> RolloutSample:
    n = len(token_ids)
    return RolloutSample(
        token_ids=np.array(token_ids, np.int32),
        loss_mask=np.ones(n, bool),
        inference_logprobs=np.zeros(n, np.float32),
        advantages=np.ones(n, np.float32),
        temperatures=np.ones(n, np.float32),
        policy_versions=np.zeros(n, np.int32),
        routed_experts=routed,
    )


def _routing(n: int, layers: int = 4, top_k: int = 2, expert: int = 3) -> np.ndarray:
    return np.full((n, layers, top_k), expert, np.uint8)


def _check(*samples: RolloutSample, args=MOE) -> None:
    check_batch_fits_model(RolloutBatch(step=1, samples=list(samples)), args, WHERE)


def test_a_batch_that_fits_passes():
    _check(_sample([1, 2, 3], _routing(3)), _sample([0, 259], _routing(2, expert=7)))


def test_expert_ids_outside_the_model_are_rejected_naming_sample_and_field():
    routed = _routing(3)
    routed[2, 1, 0] = 8
    with pytest.raises(
        BatchFormatError, match=rf"{WHERE}: sample 1: field 'routed_experts' holds expert 8, the model has 8"
    ):
        _check(_sample([1, 2, 3], _routing(3)), _sample([1, 2, 3], routed))


def test_routing_of_another_model_shape_is_rejected():
    with pytest.raises(
        BatchFormatError,
        match=r"sample 0: field 'routed_experts' has \[layers, top_k\] = \[4, 3\], .*\[4, 2\]",
    ):
        _check(_sample([1, 2], _routing(2, top_k=3)))


@pytest.mark.parametrize("bad_id", [260, -1])
def test_token_ids_outside_the_vocab_are_rejected_naming_the_id(bad_id):
    with pytest.raises(
        BatchFormatError, match=rf"sample 0: field 'token_ids' holds id {bad_id}, outside .* 260"
    ):
        _check(_sample([1, bad_id, 5]))


def test_a_dense_model_ignores_routing():
    _check(_sample([1, 2], _routing(2, layers=7, expert=200)), args=preset_args("tiny-dense"))
