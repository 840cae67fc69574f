"""Embedded inference: paged-KV continuous-batching engine on `asyncrl.model`, and its HTTP server.

    from asyncrl.inference import Engine, SamplingOptions
    engine = Engine.from_config(InferenceConfig(model="outputs/tiny-moe"))

Run the server with `asyncrl inference --model DIR` (see docs/inference.md).
"""

from asyncrl.inference.engine import Engine
from asyncrl.inference.request import FinishReason, InvalidRequestError, RequestOutput, SamplingOptions

__all__ = ["Engine", "FinishReason", "InvalidRequestError", "RequestOutput", "SamplingOptions"]
