"""asyncrl's weight-transfer engine for vLLM: every worker receives policy versions over asyncrl's
update channels while vLLM generates, and loads one from memory inside a pause.

With `[weights] transport = "distributed"` the launcher starts vLLM with
`--weight-transfer-config '{"backend": "asyncrl"}'` and the run's weights endpoint in the
environment (`asyncrl.weight_transfer.WeightsEndpoint.to_env`). The worker extension
(asyncrl_vllm_ext.py) registers this engine under that name in vLLM's weight-transfer registry, so
vLLM builds one in every worker right after loading the model. It starts an
`asyncrl.weight_transfer.ReceiveLoop` there: the worker is a receiving rank of its server's update
channel (its rank among the server's workers), registers it in the run's control store before the
server reports healthy (the trainer then joins it and sends the current version whole), and keeps
the newest complete version staged in host memory (our names, the serving format), without
stopping the engine. VLLMBackend then drives each update through the worker extension:

    POST /collective_rpc {"method": "asyncrl_staged"}         until version >= 3 (no pause: between steps)
    POST /pause?mode=keep&clear_cache=false
    POST /collective_rpc {"method": "asyncrl_swap_weights", "kwargs": {"version": 3}}
    POST /update_weight_version {"new_version": "3"}, POST /resume

The swap converts the staged tensors to Hugging Face names, exactly as the file publisher writes
them (`asyncrl.model.hf.to_hf_tensors`), and runs vLLM's in-place reload from memory (layerwise
reload around `model.load_weights`, then the CPU MoE repair): the same code as a reload from the
version's files, fed the same bits. Nothing is touched until a complete version is staged, so a
transfer that breaks or never comes leaves vLLM serving its old weights.

vLLM's own routes (`/start_weight_update`, `/update_weights` with `{"version": 3, "timeout_s":
120}`, `/finish_weight_update`) drive the same swap for clients that speak only vLLM's API.

Runs in vLLM's interpreter. asyncrl is imported from the package folder the launcher names in
ASYNCRL_PACKAGE_DIR, that package alone: vLLM keeps its own torch and everything else.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from asyncrl_vllm_ext import repack_cpu_moe_experts
from vllm.distributed.parallel_state import get_world_group
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.reload.inplace import reload_weights

ENV_PACKAGE = "ASYNCRL_PACKAGE_DIR"


def _import_asyncrl() -> None:
    """Import the asyncrl package from ENV_PACKAGE (not its environment's site-packages)."""
    if "asyncrl" in sys.modules:
        return
    if ENV_PACKAGE not in os.environ:
        raise RuntimeError(
            f"the asyncrl weight-transfer engine needs {ENV_PACKAGE} (asyncrl's package folder); "
            "asyncrl's launcher sets it with [weights] transport = 'distributed'"
        )
    package = Path(os.environ[ENV_PACKAGE])
    spec = importlib.util.spec_from_file_location(
        "asyncrl", package / "__init__.py", submodule_search_locations=[str(package)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["asyncrl"] = module
    spec.loader.exec_module(module)


_import_asyncrl()

from asyncrl.model.hf import HFReader, build_meta_model, load_args, to_hf_tensors  # noqa: E402
from asyncrl.model.serving import SCALE_SUFFIX, ServingFormat  # noqa: E402
from asyncrl.weight_transfer import (  # noqa: E402
    ReceiveLoop,
    Staged,
    StagingTimeout,
    WeightsEndpoint,
    published_shapes,
)

__all__ = ["AsyncRLWeightTransferEngine", "expected_shapes", "hf_tensors"]

log = logging.getLogger(__name__)


@dataclass
class AsyncRLInitInfo(WeightTransferInitInfo):
    """Nothing: the rendezvous is the run's control store, named in the environment at start."""


@dataclass
class AsyncRLUpdateInfo(WeightTransferUpdateInfo):
    version: int  # load the staged version once it is >= this
    timeout_s: float | None = None  # how long to wait for it; default: the endpoint's


def expected_shapes(model_dir: str, dtype: torch.dtype) -> dict[str, tuple[int, ...]]:
    """Every tensor a version of the served model is made of (our names) and its full shape."""
    with HFReader(model_dir, load_args(model_dir)) as reader:
        model = build_meta_model(reader, dtype)
    # vLLM serves published bf16/fp32 weights and quantises itself (`[inference.fp8]` is refused)
    return published_shapes(model, ServingFormat(dtype=dtype))


def hf_tensors(state: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """A staged version (our names) under the names of the version's files: stacked experts split
    per expert (views), an FP8 weight's `_scale_inv` beside its weight."""
    for name, tensor in state.items():
        if name.endswith(SCALE_SUFFIX):
            for hf_name, t in to_hf_tensors(name.removesuffix(SCALE_SUFFIX), tensor):
                yield hf_name + SCALE_SUFFIX, t
        else:
            yield from to_hf_tensors(name, tensor)


class AsyncRLWeightTransferEngine(WeightTransferEngine[AsyncRLInitInfo, AsyncRLUpdateInfo]):
    """vLLM's `WeightTransferEngine` over asyncrl's update channels (see the module docstring)."""

    init_info_cls = AsyncRLInitInfo
    update_info_cls = AsyncRLUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        endpoint = WeightsEndpoint.from_env()
        if endpoint is None:
            raise RuntimeError(
                "--weight-transfer-config backend 'asyncrl' needs the run's weights endpoint in the "
                "environment; asyncrl's launcher sets it with [weights] transport = 'distributed'"
            )
        parallel = vllm_config.parallel_config
        if parallel.data_parallel_size > 1:
            raise RuntimeError(
                "asyncrl's weight transfer serves one replica per vLLM server (data_parallel_size 1)"
            )
        world = get_world_group()  # the server's workers: TP x PP
        num_receivers, rank = world.world_size, world.rank_in_group
        if num_receivers > 1:
            endpoint = replace(endpoint, instance=_shared_instance())
        shapes = expected_shapes(vllm_config.model_config.model, vllm_config.model_config.dtype)
        self.loop = ReceiveLoop(
            endpoint,
            local_rank=rank,
            num_receivers=num_receivers,
            expected_shapes=shapes,
            device=device if device.type == "cuda" else torch.device("cpu"),
        )
        self.loop.start()
        log.info(
            "asyncrl: worker %d of %d receives weights as server '%s'", rank, num_receivers, endpoint.server
        )

    def staged(self) -> dict[str, float | None]:
        """The newest version staged (None: none yet) and the endpoint's transfer deadline."""
        return {"version": self.loop.held_version, "timeout_s": self.loop.endpoint.timeout_s}

    def swap(self, version: int, timeout_s: float | None = None) -> dict[str, float]:
        """Load the staged version >= `version` (the same one on every worker), waiting up to
        `timeout_s` (default: the endpoint's) for it; StagingTimeout leaves the model as it was."""
        timeout_s = self.loop.endpoint.timeout_s if timeout_s is None else timeout_s
        t0 = time.perf_counter()
        staged = self._wait_agreed(version, timeout_s)
        t1 = time.perf_counter()
        _reload_from_memory(self.vllm_config, self.model, hf_tensors(staged.state))
        return {
            "version": float(staged.version),
            "wait_s": t1 - t0,
            "load_s": time.perf_counter() - t1,
            "receive_s": staged.receive_s,
            "num_bytes": float(staged.num_bytes),
        }

    def _wait_agreed(self, version: int, timeout_s: float) -> Staged:
        """The newest version >= `version` that every worker has staged. Each worker's receive loop
        completes a version on its own, and shards of two versions must never serve together; a
        worker that times out makes every worker raise (none is left waiting in a collective)."""
        world = get_world_group()
        while True:
            try:
                staged, got = self.loop.wait_staged(version, timeout_s), None
            except StagingTimeout as e:
                staged, got = None, e
            mine = -1 if staged is None else staged.version
            held = torch.tensor([mine, -mine])  # one all-reduce (max) gives the newest and the oldest
            if world.world_size > 1:
                dist.all_reduce(held, op=dist.ReduceOp.MAX, group=world.cpu_group)
            newest, oldest = int(held[0]), -int(held[1])
            if oldest < 0:
                raise got or StagingTimeout(
                    f"another worker of this server did not receive version >= {version}"
                )
            if newest == oldest:
                assert staged is not None
                return staged
            version = newest

    # -- vLLM's weight-transfer API (/start_weight_update, /update_weights, /finish_weight_update)
    def init_transfer_engine(self, init_info: AsyncRLInitInfo) -> None:
        """Nothing to do: the worker joined its channel at start."""

    def start_weight_update(self) -> None:
        """Nothing to do: versions are received in the background."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's base synchronises the accelerator, which its CPU build has not
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: AsyncRLUpdateInfo) -> None:
        self.swap(update_info.version, update_info.timeout_s)

    def finish_weight_update(self) -> None:
        """Nothing to do: the swap is complete when `update_weights` returns."""

    def shutdown(self) -> None:
        self.loop.close()


def _shared_instance() -> str:
    """A string that every worker of this start of the server shares and the next start does not:
    rank 0's random id, broadcast over vLLM's world group."""
    world = get_world_group()
    return world.broadcast_object(uuid.uuid4().hex if world.rank_in_group == 0 else None, src=0)


@torch.no_grad()
def _reload_from_memory(
    vllm_config: Any, model: torch.nn.Module, weights: Iterator[tuple[str, torch.Tensor]]
) -> None:
    """vLLM's in-place reload of checkpoint-format weights, fed from memory instead of files."""
    reload_weights(vllm_config, model, weights_iterator=weights, weights_path=None, is_checkpoint_format=True)
    repack_cpu_moe_experts(model)
