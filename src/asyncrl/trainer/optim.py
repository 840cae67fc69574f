"""AdamW and the learning-rate schedule (linear warmup, then constant or cosine)."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from asyncrl.config.trainer import OptimConfig, ScheduleConfig

__all__ = ["build_optimizer", "build_scheduler", "lr_factor"]


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters, through torch's fused kernel: one pass over each
    parameter and its moments, the same update up to rounding order. On CPU, where torch's default
    is one op at a time, it takes 2-8x less time (50M parameters on one AVX-512 core, CPU time:
    0.30 -> 0.04 s in fp32, 0.15 -> 0.07 s in bf16), a sizeable share of a small step."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, fused=True
    )


def lr_factor(index: int, cfg: ScheduleConfig, max_steps: int) -> float:
    """Multiplier of the base lr for the `index`-th optimizer step (0-based)."""
    if index < cfg.warmup_steps:
        return (index + 1) / cfg.warmup_steps
    if cfg.kind == "constant":
        return 1.0
    decay_steps = max(1, max_steps - cfg.warmup_steps)
    progress = min(1.0, (index - cfg.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: ScheduleConfig, max_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, lambda index: lr_factor(index, cfg, max_steps))
