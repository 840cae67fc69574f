"""The inference HTTP server: FastAPI app over an `AsyncEngine` (contract: docs/architecture.md).

    app = build_app(AsyncEngine(engine), tokenizer, config, model_name)   # then uvicorn.run(app, ...)

Token-in/token-out `/v1/generate` for the orchestrator (and vLLM's shape of it,
`/inference/v1/generate`, for vLLM clients), admin endpoints for weight updates,
`/metrics` in Prometheus text, and the OpenAI endpoints from `openai_api`. Every bad input gets a
4xx JSON error in OpenAI's shape whose `param` names the field.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from asyncrl.config.inference import InferenceConfig
from asyncrl.inference.async_engine import AsyncEngine, on_one_torch_thread
from asyncrl.inference.engine import Engine
from asyncrl.inference.metrics import render_metrics
from asyncrl.inference.openai_api import add_openai_routes
from asyncrl.inference.protocol import error_response, to_options
from asyncrl.inference.request import InvalidRequestError, RequestFailedError
from asyncrl.inference.serving import ClientDisconnected, ServerState, collect
from asyncrl.model import ModelConfigError
from asyncrl.model.hf import check_state_dict
from asyncrl.weight_transfer import ReceiveLoop, StagingTimeout, as_dtype
from asyncrl.wire import (
    GenerateRequest,
    GenerateResponse,
    PauseRequest,
    PauseResponse,
    ResumeResponse,
    UpdateWeightsRequest,
    UpdateWeightsResponse,
    WeightsInfo,
)
from asyncrl.wire.binary import GENERATE_MEDIA_TYPE, encode_generate
from asyncrl.wire.http import FieldValueError
from asyncrl.wire.vllm import VLLMGenerateRequest, to_vllm_answer

__all__ = ["build_app"]

_OPEN_PATHS = ("/health",)


def build_app(
    engine: AsyncEngine,
    tokenizer: Any,
    config: InferenceConfig,
    model_name: str,
    receiver: ReceiveLoop | None = None,
) -> FastAPI:
    """`receiver`: the thread that takes versions from the trainer (`[weights] transport = "distributed"`)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        if receiver is not None:
            receiver.start()
        yield
        if receiver is not None:
            receiver.close()
        engine.stop()

    app = FastAPI(title="asyncrl inference", lifespan=lifespan)
    app.state.server = ServerState(
        engine=engine,
        tokenizer=tokenizer,
        config=config,
        model_name=model_name,
        max_token_chars=_max_token_chars(tokenizer),
    )
    app.state.receiver = receiver
    _install_error_handlers(app)
    # Added last = outermost: a request without the key is refused before its body is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes)
    _install_api_key(app, config.api_key)
    _add_core_routes(app)
    _add_admin_routes(app)
    add_openai_routes(app)
    return app


def _max_token_chars(tokenizer: Any) -> int:
    """Characters of text one token can cover, at most: the longest vocabulary entry, times 4.

    The slack covers normalizers that shrink text before splitting it (Unicode composition).
    """
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    return 4 * max((len(t) for t in vocab), default=64)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation(_: Request, exc: RequestValidationError):
        err = exc.errors()[0]
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        if isinstance(cause := err.get("ctx", {}).get("error"), FieldValueError):
            loc.append(cause.field)  # a model-level validator that knows which nested field is bad
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

    @app.exception_handler(RequestFailedError)
    async def on_failed(_: Request, exc: RequestFailedError):
        return error_response(500, str(exc), None, "server_error")

    @app.exception_handler(ClientDisconnected)
    async def on_disconnect(_: Request, exc: ClientDisconnected):
        return error_response(499, "client disconnected", None)


def _install_api_key(app: FastAPI, api_key: str | None) -> None:
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)


class ApiKeyMiddleware:
    """Checks `Authorization: Bearer KEY` (scheme in any case) on every path but /health.

    A plain ASGI middleware: Starlette's BaseHTTPMiddleware would hide client disconnects from
    the handlers, and a disconnected client must free its request.
    """

    def __init__(self, app: Any, api_key: str) -> None:
        self.app, self.expected = app, api_key.encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in _OPEN_PATHS:
            scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").strip().partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(given.strip(), self.expected):
                response = error_response(
                    401, "missing or wrong API key", "Authorization", "authentication_error"
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Refuses request bodies over `max_bytes` with 413, before any handler parses them.

    The body is read here (as FastAPI would) and replayed to the app; a declared Content-Length
    over the limit is refused without reading anything.
    """

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        too_large = not declared.isdigit() or int(declared) > self.max_bytes
        chunks, size, more = [], 0, not too_large
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left; let the app see it
                chunks.append(message)
                break
            size += len(message.get("body", b""))
            chunks.append(message)
            more = message.get("more_body", False)
            too_large = size > self.max_bytes
            more = more and not too_large
        if too_large:
            text = f"request body exceeds {self.max_bytes} bytes (max_request_bytes)"
            await error_response(413, text, "body")(scope, receive, send)
            return
        body = b"".join(m.get("body", b"") for m in chunks if m["type"] == "http.request")
        replay = [{"type": "http.request", "body": body, "more_body": False}]
        replay += [m for m in chunks if m["type"] != "http.request"]

        async def replayed() -> dict:
            return replay.pop(0) if replay else await receive()

        await self.app(scope, replayed, send)


def _add_core_routes(app: FastAPI) -> None:
    state: ServerState = app.state.server

    @app.get("/health")
    async def health() -> dict[str, str | bool]:
        # 200 while paused too: a paused server is alive (mid weight update, or left paused by a
        # failed one); `paused` tells a rejoining client that it must `/resume` it.
        return {"status": "ok", "paused": state.engine.paused}

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
        text = render_metrics(state.engine.stats(), paused=state.engine.paused, counters=state.counters)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def run(body: GenerateRequest, http: Request, prompt_field: str) -> GenerateResponse:
        options = to_options(body, body.max_tokens)
        try:
            result = await collect(
                state,
                http,
                body.prompt_token_ids,
                options,
                cache_salt=body.cache_salt,
                return_routed_experts=body.return_routed_experts,
                routed_experts_start=body.routed_experts_start,
            )
        except InvalidRequestError as e:
            # The engine names the field "prompt"; these endpoints name it as their body does.
            field = prompt_field if e.field == "prompt" else e.field
            raise InvalidRequestError(field, e.message, e.status) from None
        return result.to_response(body)

    @app.post("/v1/generate", response_model=GenerateResponse)
    async def generate(body: GenerateRequest, http: Request) -> GenerateResponse | Response:
        """JSON, or the binary body (routing as raw bytes) for a client whose `Accept` names it."""
        response = await run(body, http, "prompt_token_ids")
        if GENERATE_MEDIA_TYPE in http.headers.get("accept", ""):
            return Response(encode_generate(response), media_type=GENERATE_MEDIA_TYPE)
        return response

    @app.post("/inference/v1/generate")
    async def generate_vllm_shape(body: VLLMGenerateRequest, http: Request) -> dict[str, Any]:
        """vLLM 0.32's token-in/token-out shape, so that vLLM clients (and VLLMBackend) speak to us."""
        try:
            request = body.to_request()
        except ValidationError as e:  # GenerateRequest's own bounds (seed range, valid Unicode, ...)
            err = e.errors()[0]
            raise InvalidRequestError(".".join(str(p) for p in err["loc"]) or "body", err["msg"]) from None
        answer = await run(request, http, "token_ids")
        handoff = _kv_handoff(body.kv_transfer_params, body.request_id or "")
        return to_vllm_answer(answer, request, body.request_id or "", kv_transfer_params=handoff)


def _kv_handoff(params: dict[str, Any] | None, request_id: str) -> dict[str, Any] | None:
    """A prefill/decode pair's parameters, answered as a server without a KV connector can: a prefill
    hop (`do_remote_decode`) gets parameters that name no blocks, and the decode hop that brings them
    computes the whole prompt itself, so the pair's answer is what one server would give."""
    if not params or not params.get("do_remote_decode"):
        return None
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "asyncrl-embedded",
        "remote_request_id": request_id,
        "remote_block_ids": [],
        "remote_host": None,
        "remote_port": None,
    }


def _add_admin_routes(app: FastAPI) -> None:
    state: ServerState = app.state.server

    @app.post("/pause")
    async def pause(
        body: PauseRequest | None = None, mode: Literal["keep", "abort"] | None = None
    ) -> PauseResponse:
        """Mode from the body, or from `?mode=` as vLLM takes it; default keep."""
        if body is not None and mode is not None and body.mode != mode:
            raise InvalidRequestError("mode", f"body says {body.mode!r}, query says {mode!r}")
        mode = mode or (body.mode if body is not None else "keep")
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
        if body.transport == "distributed":
            return await _update_from_channel(state, app.state.receiver, body)
        _check_weights_path(body.path, state.config.update_weights_roots)
        try:
            timing = await state.engine.update_weights(body.path, body.version, body.mode)
        except (ModelConfigError, OSError) as e:
            raise InvalidRequestError("path", str(e)) from None
        return UpdateWeightsResponse(**timing)


async def _update_from_channel(
    state: ServerState, receiver: ReceiveLoop | None, body: UpdateWeightsRequest
) -> UpdateWeightsResponse:
    """Swap in the newest version received (>= body.version), waiting for it up to the transfer
    timeout; 503 when it does not come (the server keeps its weights)."""
    if receiver is None:
        raise InvalidRequestError(
            "transport", "this server takes no distributed weights (its weights.transport is 'filesystem')"
        )
    engine = state.engine.engine
    t0 = time.perf_counter()
    try:
        staged = await asyncio.to_thread(receiver.wait_staged, body.version, receiver.endpoint.timeout_s)
    except StagingTimeout as e:
        raise InvalidRequestError("version", str(e), status=503) from None
    weights = await asyncio.to_thread(on_one_torch_thread(_engine_state), engine, staged.state)
    load_seconds = time.perf_counter() - t0
    paused = await state.engine.swap_weights(weights, staged.version, body.mode, body.path)
    receiver.release(staged.version)
    return UpdateWeightsResponse(
        version=staged.version,
        load_seconds=load_seconds,
        paused_seconds=paused,
        receive_seconds=staged.receive_s,
    )


def _engine_state(engine: Engine, received: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A received version in the engine's dtype (the bits its files would load as), checked."""
    weights = as_dtype(received, engine.dtype)
    check_state_dict(engine.model, weights, where="the version received from the trainer")
    return weights


def _check_weights_path(path: str, roots: list[str] | None) -> None:
    """403 unless `path` (symlinks resolved) is a directory under one of `roots` (None: anywhere)."""
    if "\x00" in path:
        raise InvalidRequestError("path", "contains a NUL character")
    if roots is None:
        return
    resolved = Path(path).resolve()
    if not any(resolved.is_relative_to(Path(root).resolve()) for root in roots):
        raise InvalidRequestError(
            "path", f"{path} is outside the allowed weight directories (update_weights_roots)", status=403
        )
