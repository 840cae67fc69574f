"""The inference client: how the orchestrator and the environments reach an inference server.

Torch-free, over HTTP only. One `InferenceBackend` object is one server (`HttpBackend` for
asyncrl's own servers, `VLLMBackend` for vLLM's; `build_backends` picks the class); the rollout
loop sees a server as an `InferenceClient`, one model turn per call::

    from asyncrl.client import HttpInferenceClient
    async with HttpInferenceClient("http://127.0.0.1:8000") as client:
        out = await client.generate(prompt_ids, SamplingParams(max_tokens=64))

Failures are `ServerUnavailable` (retry elsewhere) and its base `InferenceError` (the request was
at fault). See docs/architecture.md, "Inference backends".
"""

from asyncrl.client.backend import (
    ContextLimitExceeded,
    HttpBackend,
    InferenceBackend,
    InferenceError,
    ServerUnavailable,
)
from asyncrl.client.build import BackendKind, build_backends
from asyncrl.client.inference_client import HttpInferenceClient, InferenceClient, RequestClient
from asyncrl.client.vllm_backend import VLLMBackend

__all__ = [
    "BackendKind",
    "ContextLimitExceeded",
    "HttpBackend",
    "HttpInferenceClient",
    "InferenceBackend",
    "InferenceClient",
    "InferenceError",
    "RequestClient",
    "ServerUnavailable",
    "VLLMBackend",
    "build_backends",
]
