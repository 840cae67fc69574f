"""Which backend class speaks to a kind of server: the one place that chooses.

    backends = build_backends(["http://10.0.0.1:8000"], kind="vllm", api_key=key, timeout_s=600)
    pool = ServerPool(backends)  # asyncrl.orchestrator.pool routes over them

The orchestrator's `inference_backend` setting names the kind; the pool, the dispatcher and the
weight updater see only the `InferenceBackend` protocol. With `prefill_urls` (one per URL, vLLM
only) each server is a prefill/decode pair, one `DisaggregatedBackend` (asyncrl.client.disaggregated).
"""

from __future__ import annotations

from typing import Literal

from asyncrl.client.backend import HttpBackend, InferenceBackend
from asyncrl.client.disaggregated import DisaggregatedBackend, KVHandoffBackend
from asyncrl.client.vllm_backend import VLLMBackend

__all__ = ["BackendKind", "build_backends"]

BackendKind = Literal["embedded", "vllm"]

_CLASSES: dict[str, type[HttpBackend]] = {"embedded": HttpBackend, "vllm": VLLMBackend}


def build_backends(
    urls: list[str],
    *,
    kind: BackendKind = "embedded",
    api_key: str | None = None,
    timeout_s: float = 600.0,
    prefill_urls: list[str] | None = None,
) -> list[InferenceBackend]:
    """One backend per server URL: `HttpBackend` for asyncrl's own servers, `VLLMBackend` for vLLM's;
    with `prefill_urls`, a `DisaggregatedBackend` per (prefill, decode) pair of vLLM servers."""
    if not prefill_urls:
        return [_CLASSES[kind](url, api_key=api_key, timeout_s=timeout_s) for url in urls]
    if kind != "vllm" or len(prefill_urls) != len(urls):
        raise ValueError(
            f"prefill/decode pairs need vLLM servers and one prefill URL per server; got kind {kind!r}, "
            f"{len(prefill_urls)} prefill URLs for {len(urls)} servers"
        )
    return [
        DisaggregatedBackend(
            KVHandoffBackend(prefill, api_key=api_key, timeout_s=timeout_s),
            KVHandoffBackend(decode, api_key=api_key, timeout_s=timeout_s),
        )
        for prefill, decode in zip(prefill_urls, urls, strict=True)
    ]
