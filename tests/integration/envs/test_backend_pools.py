"""A paused server holds every generation request open; the pause's own admin calls must still get
through. With one shared connection pool (httpx's default: 100 connections), 100 held requests
starved the update_weights call that would have resumed them: the run hung."""

from __future__ import annotations

import asyncio
import threading
import time

import uvicorn
from fastapi import FastAPI

from asyncrl.client import HttpBackend
from asyncrl.wire import GenerateRequest, PauseRequest, UpdateWeightsRequest
from helpers import free_port

HELD = 120  # more than httpx's default pool of 100 connections


def _paused_server() -> tuple[FastAPI, threading.Event]:
    app, release = FastAPI(), threading.Event()

    @app.post("/v1/generate")
    async def generate():
        while not release.is_set():  # paused: the request is held, as the engine holds it
            await asyncio.sleep(0.02)
        return {"token_ids": [1], "logprobs": [-0.1], "policy_versions": [1], "finish_reason": "length"}

    @app.post("/update_weights")
    async def update_weights(body: dict):
        return {"version": body["version"], "load_seconds": 0.0, "paused_seconds": 0.0}

    @app.post("/pause")
    async def pause():
        return {"paused": True, "mode": "keep", "num_aborted": 0}

    return app, release


def test_admin_calls_get_through_while_generation_requests_are_held():
    app, release = _paused_server()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)

    async def go():
        backend = HttpBackend(f"http://127.0.0.1:{port}", timeout_s=60)
        request = GenerateRequest(prompt_token_ids=[1, 2], max_tokens=1)
        held = [asyncio.create_task(backend.generate(request)) for _ in range(HELD)]
        await asyncio.sleep(1.0)  # every generation request is out (or queued for a connection)
        try:
            await asyncio.wait_for(backend.pause(PauseRequest(mode="keep")), timeout=20)
            update = UpdateWeightsRequest(path="/w/step_1", version=1)
            assert (await asyncio.wait_for(backend.update_weights(update), timeout=20)).version == 1
            assert not any(t.done() for t in held)  # still held while the admin calls went through
        finally:
            release.set()
        answers = await asyncio.wait_for(asyncio.gather(*held), timeout=60)
        assert len(answers) == HELD
        await backend.aclose()

    try:
        asyncio.run(go())
    finally:
        release.set()
        server.should_exit = True
        thread.join(timeout=10)
