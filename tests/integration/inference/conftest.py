"""A live uvicorn server on 127.0.0.1 (free port, API key set) serving a tiny random MoE model."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn

from asyncrl.config.inference import InferenceConfig
from asyncrl.inference.main import build_server_app
from asyncrl.tools.init_model import init_model
from helpers import free_port

API_KEY = "test-key"


@dataclass
class LiveServer:
    url: str
    model_dir: Path
    name: str
    app: object
    api_key: str = API_KEY

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60, **kw
        )


@contextlib.contextmanager
def live_server(model_dir: Path, **overrides) -> Iterator[LiveServer]:
    """A uvicorn server on 127.0.0.1 over `model_dir`, with InferenceConfig `overrides`."""
    cfg = InferenceConfig(
        **{
            "model": str(model_dir),
            "port": free_port(),
            "api_key": API_KEY,
            "max_num_seqs": 64,
            "kv_cache_tokens": 8192,
            "device": "cpu",
            "log_level": "warning",
        }
        | overrides
    )
    app = build_server_app(cfg)
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=cfg.port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield LiveServer(
            url=f"http://127.0.0.1:{cfg.port}", model_dir=model_dir, name=model_dir.name, app=app
        )
    finally:
        srv.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("tiny-moe")
    init_model("tiny-moe", model_dir, seed=0)
    with live_server(model_dir) as live:
        yield live


@pytest.fixture(scope="module")
def hardened(tmp_path_factory):
    """A server with weight roots (`.roots`) and a 64 KiB body limit."""
    model_dir = tmp_path_factory.mktemp("tiny-moe")
    init_model("tiny-moe", model_dir, seed=0)
    roots = tmp_path_factory.mktemp("weights")
    with live_server(model_dir, update_weights_roots=[str(roots)], max_request_bytes=64 * 1024) as live:
        live.roots = roots
        yield live
