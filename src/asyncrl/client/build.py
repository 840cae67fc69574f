"""Which backend class speaks to a kind of server: the one place that chooses.

    backends = build_backends(["http://10.0.0.1:8000"], kind="vllm", api_key=key, timeout_s=600)
    pool = ServerPool(backends)  # asyncrl.orchestrator.pool routes over them

The orchestrator's `inference_backend` setting names the kind; the pool, the dispatcher and the
weight updater see only the `InferenceBackend` protocol.
"""

from __future__ import annotations

from typing import Literal

from asyncrl.client.backend import HttpBackend, InferenceBackend
from asyncrl.client.vllm_backend import VLLMBackend

__all__ = ["BackendKind", "build_backends"]

BackendKind = Literal["embedded", "vllm"]

_CLASSES: dict[str, type[HttpBackend]] = {"embedded": HttpBackend, "vllm": VLLMBackend}


def build_backends(
    urls: list[str], *, kind: BackendKind = "embedded", api_key: str | None = None, timeout_s: float = 600.0
) -> list[InferenceBackend]:
    """One backend per server URL: `HttpBackend` for asyncrl's own servers, `VLLMBackend` for vLLM's."""
    return [_CLASSES[kind](url, api_key=api_key, timeout_s=timeout_s) for url in urls]
