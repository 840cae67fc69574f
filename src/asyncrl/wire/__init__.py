"""Torch-free messages between processes: rollout samples/batches and HTTP request/response models."""

from asyncrl.wire.http import (
    GenerateRequest,
    GenerateResponse,
    PauseRequest,
    PauseResponse,
    ResumeResponse,
    RoutedExperts,
    SamplingParams,
    UpdateWeightsRequest,
    UpdateWeightsResponse,
    WeightsInfo,
)
from asyncrl.wire.rollout import (
    BatchFormatError,
    RolloutBatch,
    RolloutSample,
    decode_batch,
    encode_batch,
    select_encoded,
    split_by_tokens,
)

__all__ = [
    "BatchFormatError",
    "GenerateRequest",
    "GenerateResponse",
    "PauseRequest",
    "PauseResponse",
    "ResumeResponse",
    "RolloutBatch",
    "RolloutSample",
    "RoutedExperts",
    "SamplingParams",
    "UpdateWeightsRequest",
    "UpdateWeightsResponse",
    "WeightsInfo",
    "decode_batch",
    "encode_batch",
    "select_encoded",
    "split_by_tokens",
]
