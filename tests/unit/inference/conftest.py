"""Fixtures of the engine tests: a tiny random MoE model and an engine factory."""

from __future__ import annotations

import copy

import pytest

from asyncrl.config.inference import InferenceConfig
from asyncrl.inference import Engine
from asyncrl.model import Transformer, preset_args


@pytest.fixture(scope="session")
def tiny_moe() -> Transformer:
    model = Transformer(preset_args("tiny-moe"))
    model.init_weights(seed=3, std=0.05)
    return model.eval()


@pytest.fixture
def make_engine(tiny_moe):
    def make(model: Transformer | None = None, **overrides) -> Engine:
        cfg = {
            "model": "unused",
            "block_size": 4,
            "kv_cache_tokens": 4096,
            "max_num_batched_tokens": 64,
        } | overrides
        return Engine(copy.deepcopy(model or tiny_moe), InferenceConfig(**cfg))

    return make
