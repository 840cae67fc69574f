"""`init_distributed` outside torchrun: world size 1, on the device the config names or `auto` picks."""

from __future__ import annotations

import torch

from asyncrl.distributed import init_distributed


def test_a_single_process_resolves_auto(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    info = init_distributed("auto")
    assert (info.rank, info.world_size, info.device) == (0, 1, torch.device("cpu"))
    assert init_distributed("cpu").device == torch.device("cpu")
