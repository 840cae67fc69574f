"""The one place a configured device name becomes a torch device, for every process.

resolve_device("auto")                  # cuda:0 when a CUDA device is visible, else cpu
resolve_device("cuda", local_rank=1)    # cuda:1: the device of torchrun's LOCAL_RANK 1
"""

from __future__ import annotations

import torch

__all__ = ["resolve_device"]


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """The device called `name` ("auto", "cpu" or "cuda"); a cuda process takes cuda:`local_rank`."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if name != "cuda":
        raise ValueError(f"unknown device {name!r}; expected 'auto', 'cpu' or 'cuda'")
    if not torch.cuda.is_available():
        raise ValueError("device = 'cuda' but no CUDA device is available; use device = 'cpu' or 'auto'")
    return torch.device("cuda", local_rank)
