"""The inference HTTP server: FastAPI app over an `AsyncEngine` (contract: ARCHITECTURE.md).

    app = build_app(AsyncEngine(engine), tokenizer, config, model_name)   # then uvicorn.run(app, ...)

Token-in/token-out `/v1/generate` for the orchestrator, admin endpoints for weight updates,
`/metrics` in Prometheus text, and the OpenAI endpoints from `openai_api`. Every bad input gets a
4xx JSON error in OpenAI's shape whose `param` names the field.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from asyncrl.config.inference import InferenceConfig
from asyncrl.inference.async_engine import AsyncEngine
from asyncrl.inference.metrics import render_metrics
from asyncrl.inference.openai_api import add_openai_routes
from asyncrl.inference.protocol import error_response, to_options
from asyncrl.inference.request import InvalidRequestError
from asyncrl.inference.serving import ClientDisconnected, ServerState, collect
from asyncrl.model import ModelConfigError
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

__all__ = ["build_app"]

_OPEN_PATHS = ("/health",)


def build_app(engine: AsyncEngine, tokenizer: Any, config: InferenceConfig, model_name: str) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="asyncrl inference", lifespan=lifespan)
    app.state.server = ServerState(engine=engine, tokenizer=tokenizer, config=config, model_name=model_name)
    _install_error_handlers(app)
    _install_api_key(app, config.api_key)
    _add_core_routes(app)
    _add_admin_routes(app)
    add_openai_routes(app)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation(_: Request, exc: RequestValidationError):
        err = exc.errors()[0]
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        param = ".".join(loc) or "body"
        if err.get("type") == "json_invalid":
            return error_response(400, f"malformed JSON body: {err.get('msg')}", "body")
        return error_response(400, f"{param}: {err.get('msg')}", param)

    @app.exception_handler(InvalidRequestError)
    async def on_invalid(_: Request, exc: InvalidRequestError):
        return error_response(exc.status, exc.message, exc.field)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(_: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), None)

    @app.exception_handler(ClientDisconnected)
    async def on_disconnect(_: Request, exc: ClientDisconnected):
        return error_response(499, "client disconnected", None)


def _install_api_key(app: FastAPI, api_key: str | None) -> None:
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)


class ApiKeyMiddleware:
    """Checks `Authorization: Bearer KEY` on every path but /health.

    A plain ASGI middleware: Starlette's BaseHTTPMiddleware would hide client disconnects from
    the handlers, and a disconnected client must free its request.
    """

    def __init__(self, app: Any, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in _OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                response = error_response(
                    401, "missing or wrong API key", "Authorization", "authentication_error"
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _add_core_routes(app: FastAPI) -> None:
    state: ServerState = app.state.server

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": state.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "asyncrl",
            "max_model_len": state.engine.engine.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        text = render_metrics(state.engine.engine.stats(), paused=state.engine.paused)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.post("/v1/generate")
    async def generate(body: GenerateRequest, http: Request) -> GenerateResponse:
        options = to_options(body, body.max_tokens)
        try:
            result = await collect(
                state, http, body.prompt_token_ids, options, cache_salt=body.cache_salt,
                return_routed_experts=body.return_routed_experts, routed_experts_start=body.routed_experts_start,
            )  # fmt: skip
        except InvalidRequestError as e:
            # The engine names the field "prompt"; this endpoint calls it prompt_token_ids.
            field = "prompt_token_ids" if e.field == "prompt" else e.field
            raise InvalidRequestError(field, e.message, e.status) from None
        routed = None
        if result.routed_experts is not None:
            start = min(body.routed_experts_start, len(body.prompt_token_ids))
            routed = RoutedExperts.from_array(result.routed_experts, start=start)
        return GenerateResponse(
            token_ids=result.token_ids, logprobs=result.logprobs, policy_versions=result.versions,
            finish_reason=result.finish_reason, num_cached_tokens=result.num_cached_tokens,
            prompt_token_ids=body.prompt_token_ids, routed_experts=routed,
        )  # fmt: skip


def _add_admin_routes(app: FastAPI) -> None:
    state: ServerState = app.state.server

    @app.post("/pause")
    async def pause(body: PauseRequest | None = None) -> PauseResponse:
        mode = body.mode if body is not None else "keep"
        aborted = await state.engine.pause(mode)
        return PauseResponse(paused=True, mode=mode, num_aborted=aborted)

    @app.post("/resume")
    async def resume() -> ResumeResponse:
        await state.engine.resume()
        return ResumeResponse(paused=False)

    @app.get("/weights")
    async def weights() -> WeightsInfo:
        return WeightsInfo(version=state.engine.engine.version, path=state.engine.weights_path)

    @app.post("/update_weights")
    async def update_weights(body: UpdateWeightsRequest) -> UpdateWeightsResponse:
        try:
            timing = await state.engine.update_weights(body.path, body.version, body.mode)
        except (ModelConfigError, OSError) as e:
            raise InvalidRequestError("path", str(e)) from None
        return UpdateWeightsResponse(**timing)
