"""The one table between dtype names (config files, HF `torch_dtype`) and torch dtypes.

torch_dtype("bfloat16")        # torch.bfloat16
dtype_name(torch.float32)      # "float32"
"""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "dtype_name", "torch_dtype"]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called `name`; ValueError naming the choices otherwise."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """The name of `dtype` as config.json spells it; ValueError for dtypes we never write."""
    for name, d in DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"unsupported weight dtype {dtype}; expected one of {sorted(DTYPES)}")
