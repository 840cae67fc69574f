"""Keys that several processes' configs hold alike, declared once: run directory, row length, device.

run_dir: str = Field(DEFAULT_RUN_DIR, description=...)
seq_len: SeqLen = DEFAULT_SEQ_LEN
device: Device = "auto"        # resolved to cuda when one is available, else cpu, at start
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

__all__ = ["DEFAULT_RUN_DIR", "DEFAULT_SEQ_LEN", "Device", "SeqLen"]

DEFAULT_RUN_DIR = "outputs/run"
DEFAULT_SEQ_LEN = 2048

SeqLen = Annotated[
    int,
    Field(
        gt=0,
        description="tokens of one packed trainer row (micro-batch): no sample may be longer, and every "
        "env's max_total_tokens must fit it",
    ),
]

# Where a process computes. "auto" is cuda when a CUDA device is visible, else cpu; a process that
# uses cuda takes the device of its LOCAL_RANK (cuda:0 outside torchrun).
Device = Literal["auto", "cpu", "cuda"]
