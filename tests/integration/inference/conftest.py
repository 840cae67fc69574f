"""A live uvicorn server on 127.0.0.1 (free port, API key set) serving a tiny random MoE model."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn

from asyncrl.config.inference import InferenceConfig
from asyncrl.inference.main import build_server_app
from asyncrl.launcher.init_model import init_model
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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("tiny-moe")
    init_model("tiny-moe", model_dir, seed=0)
    cfg = InferenceConfig(
        model=str(model_dir), port=free_port(), api_key=API_KEY, max_num_seqs=64, kv_cache_tokens=8192,
        device="cpu", log_level="warning",
    )  # fmt: skip
    app = build_server_app(cfg)
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=cfg.port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    yield LiveServer(url=f"http://127.0.0.1:{cfg.port}", model_dir=model_dir, name=model_dir.name, app=app)
    srv.should_exit = True
    thread.join(timeout=30)
