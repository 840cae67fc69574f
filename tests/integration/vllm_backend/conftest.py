"""Module-scoped fixtures: two tiny MoEs (v0 served, v1 to load) and one live vLLM server over v0."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_helpers import HAS_VLLM, NO_VLLM, VLLMServer, vllm_server

from asyncrl.tools.init_model import init_model


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    """Two tiny MoEs with different weights: the served one, and the 'next version' to load."""
    root = tmp_path_factory.mktemp("vllm-models")
    init_model("tiny-moe", root / "v0", seed=0)
    init_model("tiny-moe", root / "v1", seed=1)
    return root / "v0", root / "v1"


@pytest.fixture(scope="module")
def server(models, tmp_path_factory) -> Iterator[VLLMServer]:
    if not HAS_VLLM:
        pytest.skip(NO_VLLM)
    with vllm_server(models[0], tmp_path_factory.mktemp("vllm-log") / "vllm.log") as s:
        yield s
