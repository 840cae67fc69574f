"""Module-scoped fixtures: two tiny MoEs (v0 served, v1 to load), the run's weights store (hosted
here, as trainer rank 0 hosts it in a run), and one live vLLM server over v0 whose workers receive
versions through that store (docs/weights-transfer.md) as well as reload them from files."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_helpers import HAS_VLLM, NO_VLLM, VLLMServer, vllm_server

from asyncrl.tools.init_model import init_model
from asyncrl.weight_transfer import host_store
from helpers import free_port

# a version that does not come within this is given up (tests of a broken transfer wait it out)
TRANSFER_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    """Two tiny MoEs with different weights: the served one, and the 'next version' to load."""
    root = tmp_path_factory.mktemp("vllm-models")
    init_model("tiny-moe", root / "v0", seed=0)
    init_model("tiny-moe", root / "v1", seed=1)
    return root / "v0", root / "v1"


@pytest.fixture(scope="module")
def weights_store() -> tuple[int, object]:
    """The run's control store for one trainer rank (this process): its port and the store."""
    port = free_port()
    return port, host_store(port, num_senders=1)


@pytest.fixture(scope="module")
def server(models, weights_store, tmp_path_factory) -> Iterator[VLLMServer]:
    if not HAS_VLLM:
        pytest.skip(NO_VLLM)
    weights = {"transport": "distributed", "endpoint": f"127.0.0.1:{weights_store[0]}"}
    log = tmp_path_factory.mktemp("vllm-log") / "vllm.log"
    with vllm_server(models[0], log, weights=weights | {"timeout_s": TRANSFER_TIMEOUT_S}) as s:
        yield s
