"""build_backends: one backend per URL, of the class the server kind names."""

from __future__ import annotations

import asyncio

from asyncrl.client import HttpBackend, InferenceBackend, VLLMBackend, build_backends


def _close(backends) -> None:
    async def close_all():
        await asyncio.gather(*(b.aclose() for b in backends))

    asyncio.run(close_all())


def test_embedded_servers_get_http_backends_and_vllm_servers_vllm_backends():
    embedded = build_backends(["http://a:8000/", "http://b:8000"])
    vllm = build_backends(["http://c:8000"], kind="vllm", api_key="k", timeout_s=5.0)
    assert [type(b) for b in embedded] == [HttpBackend, HttpBackend]
    assert [b.url for b in embedded] == ["http://a:8000", "http://b:8000"]
    assert [type(b) for b in vllm] == [VLLMBackend] and vllm[0].url == "http://c:8000"
    assert all(isinstance(b, InferenceBackend) for b in [*embedded, *vllm])
    _close([*embedded, *vllm])
