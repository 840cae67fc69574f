"""SafetensorsFile: positioned reads of blocks equal safetensors' own slicing; bad files are named."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from asyncrl.model.safetensors_file import SafetensorsError, SafetensorsFile

BLOCKS = [
    (slice(0, 5), slice(0, 6), slice(0, 7)),  # whole
    (slice(1, 3), slice(0, 6), slice(0, 7)),  # leading rows: one run
    (slice(1, 4), slice(2, 5), slice(0, 7)),  # rows of each of 3 blocks
    (slice(0, 5), slice(0, 6), slice(3, 4)),  # one column: a run per (i, j)
    (slice(2, 2), slice(0, 6), slice(0, 7)),  # empty
]


@pytest.fixture
def file(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(5, 6, 7, generator=gen),
        "bf16": torch.randn(5, 6, 7, generator=gen).bfloat16(),
        "scalar": torch.tensor(3.5),
    }
    path = tmp_path / "t.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("block", BLOCKS)
def test_blocks_equal_safetensors_slices(file, block):
    f = SafetensorsFile(file)
    with safe_open(str(file), framework="pt") as ref:
        for name in ("f32", "bf16"):
            got = f.read(name, block)
            want = ref.get_slice(name)[block]
            assert got.dtype == want.dtype and torch.equal(got, want), name
        assert f.read("scalar", ()).item() == 3.5
    assert f.entries["bf16"].shape == (5, 6, 7) and f.entries["bf16"].dtype == "BF16"
    f.close()


def test_truncated_and_garbage_files_are_rejected(file):
    data = file.read_bytes()
    file.write_bytes(data[:-10])
    with pytest.raises(SafetensorsError, match=r"spans bytes .* \(truncated\?\)"):
        SafetensorsFile(file)
    file.write_bytes(b"\x00" * 64)
    with pytest.raises(SafetensorsError, match="header size 0"):
        SafetensorsFile(file)
    file.write_bytes((20).to_bytes(8, "little") + b"{not json" + b" " * 11)
    with pytest.raises(SafetensorsError, match="header is not JSON"):
        SafetensorsFile(file)
