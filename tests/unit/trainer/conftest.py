"""Tiny models and a single-process StepRunner for trainer unit tests."""

from __future__ import annotations

import pytest
import torch

from asyncrl.config.trainer import OptimConfig, ScheduleConfig
from asyncrl.distributed import DistInfo
from asyncrl.model import Transformer, preset_args
from asyncrl.trainer.optim import build_optimizer, build_scheduler
from asyncrl.trainer.step import StepRunner

SINGLE = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def build_tiny_model(preset: str = "tiny-moe", seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(preset_args(preset))
    model.init_weights(seed=seed)
    return model


def build_step_runner(
    model: Transformer, lr: float = 1e-3, chunk_size: int = 1024, max_grad_norm: float = 1.0
) -> StepRunner:
    optimizer = build_optimizer(model, OptimConfig(lr=lr))
    scheduler = build_scheduler(optimizer, ScheduleConfig(), max_steps=100)
    return StepRunner(model, optimizer, scheduler, SINGLE, max_grad_norm=max_grad_norm, chunk_size=chunk_size)


@pytest.fixture
def tiny_model():
    """Factory: tiny_model(preset="tiny-moe", seed=0) -> a freshly initialised Transformer."""
    return build_tiny_model


@pytest.fixture
def make_step_runner():
    """Factory: make_step_runner(model, lr=1e-3, chunk_size=1024) -> a single-process StepRunner."""
    return build_step_runner
