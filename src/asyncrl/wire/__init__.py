"""Torch-free messages between processes: rollout samples/batches and HTTP request/response models."""

from asyncrl.wire.http import (
    GenerateRequest,
    GenerateResponse,
    PauseRequest,
    RoutedExperts,
    SamplingParams,
    UpdateWeightsRequest,
    UpdateWeightsResponse,
)
from asyncrl.wire.rollout import BatchFormatError, RolloutBatch, RolloutSample, decode_batch, encode_batch

__all__ = [
    "BatchFormatError",
    "GenerateRequest",
    "GenerateResponse",
    "PauseRequest",
    "RolloutBatch",
    "RolloutSample",
    "RoutedExperts",
    "SamplingParams",
    "UpdateWeightsRequest",
    "UpdateWeightsResponse",
    "decode_batch",
    "encode_batch",
]
