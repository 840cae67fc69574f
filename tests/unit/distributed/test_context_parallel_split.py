"""CP helpers that need no process group: padding and contiguous splitting of per-token streams."""

from __future__ import annotations

import pytest
import torch

from asyncrl.distributed import pad_for_cp, split_for_cp


def test_split_gives_contiguous_chunks_that_concatenate_back():
    x = torch.arange(12).view(1, 12)
    chunks = [split_for_cp(x, 3, r, dim=1) for r in range(3)]
    assert chunks[1].tolist() == [[4, 5, 6, 7]]
    assert torch.equal(torch.cat(chunks, dim=1), x)


def test_pad_then_split_and_uneven_length_error():
    pos = torch.tensor([[0, 1, 2, 0, 1]])
    padded = pad_for_cp(pos, 4, dim=1, value=0)
    assert padded.tolist() == [[0, 1, 2, 0, 1, 0, 0, 0]]
    with pytest.raises(ValueError, match=r"length 5 along dim 1 is not a multiple of cp \(4\)"):
        split_for_cp(pos, 4, 0, dim=1)
