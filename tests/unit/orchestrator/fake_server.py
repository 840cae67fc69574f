"""A stand-in inference server speaking the asyncrl HTTP API, for orchestrator tests without torch.

It "samples" random lowercase letters then eos, stamps every token with its current weight version,
and can add a heavy-tailed delay per request. `update_weights` only records the version and path.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time

import numpy as np
import uvicorn
from fastapi import FastAPI

from asyncrl.wire import (
    GenerateRequest,
    GenerateResponse,
    PauseRequest,
    PauseResponse,
    ResumeResponse,
    RoutedExperts,
    UpdateWeightsRequest,
    UpdateWeightsResponse,
    WeightsInfo,
)
from helpers import free_port

EOS = 258
NUM_LAYERS, TOP_K = 2, 2


class FakeServer:
    def __init__(
        self,
        *,
        seed: int = 0,
        delay_median_s: float = 0.0,
        delay_sigma: float = 0.0,
        port: int | None = None,
        hang_after: int | None = None,
    ) -> None:
        """`hang_after`: requests after the first N never answer (a server that stops responding)."""
        self.version = 0
        self.loaded_paths: list[str] = []
        self.num_requests = 0
        self.paused = False
        self.rng = random.Random(seed)
        self.delay_median_s, self.delay_sigma = delay_median_s, delay_sigma
        self.hang_after = hang_after
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = self._build_app()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health():
            return {"status": "ok"}

        @app.post("/v1/generate")
        async def generate(req: GenerateRequest) -> GenerateResponse:
            self.num_requests += 1
            if self.hang_after is not None and self.num_requests > self.hang_after:
                await asyncio.Event().wait()
            if self.delay_median_s:
                await asyncio.sleep(
                    self.delay_median_s * float(np.exp(self.delay_sigma * self.rng.gauss(0, 1)))
                )
            n = self.rng.randint(1, min(6, req.max_tokens))
            tokens = [self.rng.randint(97, 122) for _ in range(n - 1)] + [EOS]
            routing = None
            if req.return_routed_experts:
                total = len(req.prompt_token_ids) + len(tokens)
                arr = np.zeros((total - req.routed_experts_start, NUM_LAYERS, TOP_K), np.uint8)
                arr[..., 1] = 1
                routing = RoutedExperts.from_array(arr, start=req.routed_experts_start)
            return GenerateResponse(
                token_ids=tokens,
                logprobs=[-1.0] * len(tokens),
                policy_versions=[self.version] * len(tokens),
                finish_reason="stop",
                num_cached_tokens=0,
                routed_experts=routing,
            )

        @app.get("/weights")
        async def weights() -> WeightsInfo:
            return WeightsInfo(
                version=self.version, path=self.loaded_paths[-1] if self.loaded_paths else None
            )

        @app.post("/pause")
        async def pause(req: PauseRequest) -> PauseResponse:
            self.paused = True
            return PauseResponse(paused=True, mode=req.mode, num_aborted=0)

        @app.post("/resume")
        async def resume() -> ResumeResponse:
            self.paused = False
            return ResumeResponse(paused=False)

        @app.post("/update_weights")
        async def update(req: UpdateWeightsRequest) -> UpdateWeightsResponse:
            self.version = req.version
            self.loaded_paths.append(req.path)
            return UpdateWeightsResponse(version=req.version, load_seconds=0.0, paused_seconds=0.0)

        return app

    def start(self) -> FakeServer:
        config = uvicorn.Config(
            self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._server.force_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
