"""A configured device name becomes a torch device in one place, for every process."""

from __future__ import annotations

import pytest
import torch

from asyncrl.model.devices import resolve_device


@pytest.mark.parametrize(("cuda", "want"), [(True, torch.device("cuda", 0)), (False, torch.device("cpu"))])
def test_auto_is_cuda_when_available_else_cpu(monkeypatch, cuda, want):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert resolve_device("auto") == want
    assert resolve_device("cpu") == torch.device("cpu")


def test_cuda_takes_the_local_rank_and_needs_a_cuda_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("cuda", local_rank=3) == torch.device("cuda", 3)
    assert resolve_device("auto", local_rank=1) == torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="no CUDA device is available; use device = 'cpu' or 'auto'"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="unknown device 'gpu'"):
        resolve_device("gpu")
