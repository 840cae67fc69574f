"""asyncrl's vLLM worker extension: runs inside vLLM's own interpreter, never inside asyncrl's.

The launcher puts this folder on the vLLM server's PYTHONPATH and passes
`--worker-extension-cls asyncrl_vllm_ext.AsyncRLWorkerExtension`. The class is mixed into every
vLLM worker, and its methods are callable through `POST /collective_rpc`:

    {"method": "asyncrl_reload_weights", "kwargs": {"weights_path": "/run/weights/step_12"}}

`asyncrl_reload_weights` is vLLM's in-place `reload_weights` followed by a repair that vLLM 0.32's
CPU build needs. At start-up, vLLM's CPU MoE experts prepack w13/w2 into the layout of their
grouped GEMM (`CPUUnquantizedExperts.process_weights_after_loading`). A reload runs the MoE layer's
processing again, but that step is skipped on a weight update, so the new weights land unpacked
in storage that the kernel reads as packed: the served model is wrong after every update (reloading
the very weights it serves moved teacher-forced KL from 2e-4 to 1.7-3.3). The repair prepacks the
reloaded expert weights in place. Other layers are unaffected (their CPU GEMM dispatch is redone by
the reload), and GPU builds need no repair: the method is a plain reload there.

With `[weights] transport = "distributed"` the workers receive versions over asyncrl's update
channels instead (asyncrl_vllm_receive.py, the weight-transfer engine this module registers with
vLLM as "asyncrl"), and two more methods drive an update from memory:

    {"method": "asyncrl_staged"}                            -> {"version": 2 (or None), "timeout_s": 120}
    {"method": "asyncrl_swap_weights", "kwargs": {"version": 3}}       (timeout_s: the endpoint's)

Only torch and vLLM are imported here; asyncrl only by the engine, once vLLM builds it.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

__all__ = ["ENGINE_NAME", "AsyncRLWorkerExtension", "register_engine", "repack_cpu_moe_experts"]

ENGINE_NAME = "asyncrl"  # --weight-transfer-config '{"backend": "asyncrl"}'


def register_engine() -> bool:
    """Register asyncrl's weight-transfer engine with vLLM (by module path: imported only when a
    server is started with it); False without vLLM's weight-transfer registry."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        return False
    with contextlib.suppress(ValueError):  # registered already in this process
        WeightTransferEngineFactory.register_engine(
            ENGINE_NAME, "asyncrl_vllm_receive", "AsyncRLWeightTransferEngine"
        )
    return True


# vLLM imports this module in each worker before it builds the worker and its engine
register_engine()


@torch.no_grad()
def repack_cpu_moe_experts(model: torch.nn.Module) -> int:
    """Prepack freshly reloaded (plain-layout) CPU MoE expert weights in place; the layer count."""
    try:
        from vllm._custom_ops import cpu_prepack_moe_weight
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # no vLLM here, or a build without the CPU MoE backend: nothing to repair
        return 0
    count = 0
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        # zentorch reads the plain layout, which a reload writes correctly
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
            continue
        if not hasattr(module, "w13_weight"):
            continue
        config = experts.moe_config
        if experts._padded_intermediate_size(config) != config.intermediate_size_per_partition:
            raise RuntimeError(
                f"{name}: the CPU MoE kernel pads the intermediate size "
                f"{config.intermediate_size_per_partition}; asyncrl cannot repack such a layer after a "
                "reload (use an intermediate size that is a multiple of 32, or restart vLLM per update)"
            )
        for weight in (module.w13_weight, module.w2_weight):
            weight.data.copy_(cpu_prepack_moe_weight(weight.data, experts.isa))
        count += 1
    return count


class AsyncRLWorkerExtension:
    """Methods mixed into vLLM's worker class (`self` is the worker)."""

    def asyncrl_reload_weights(self, weights_path: str) -> dict[str, float]:
        """vLLM's in-place reload from an HF safetensors folder, then the CPU MoE repair."""
        t0 = time.perf_counter()
        self.reload_weights(weights_path=weights_path, is_checkpoint_format=True)
        repacked = repack_cpu_moe_experts(self.model_runner.get_model())
        return {"seconds": time.perf_counter() - t0, "repacked_moe_layers": float(repacked)}

    def asyncrl_staged(self) -> dict[str, float | None]:
        """The newest version this worker's receive loop holds complete (None: none yet), and how
        long a transfer may take (the run's `[weights] timeout_s`)."""
        return self._asyncrl_engine().staged()

    def asyncrl_swap_weights(self, version: int, timeout_s: float | None = None) -> dict[str, float]:
        """Load the staged version >= `version` from memory (waiting up to `timeout_s`, default the
        endpoint's, for it); the loaded version and the times. Raises, leaving the weights as they
        were, when none comes."""
        return self._asyncrl_engine().swap(version, timeout_s)

    def _asyncrl_engine(self) -> Any:
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None or not hasattr(engine, "swap"):
            raise RuntimeError(
                "this vLLM server receives no weights over asyncrl's channels: start it with "
                f'--weight-transfer-config \'{{"backend": "{ENGINE_NAME}"}}\' ([weights] transport = '
                "'distributed' in asyncrl rl)"
            )
        return engine
