"""An embedded server with `weights.transport = "distributed"` against a trainer's sending thread.

The trainer side is a `SendLoop` in this process (one rank, fp32 serving as the server's dtype);
the server is a live uvicorn app. It takes v0 when it joins; a request running during the update
to v1 keeps its KV (its context version stays 0, nothing is preempted) and its later tokens carry
v1; the weights swapped in equal, bit for bit, those the server reads from v1's files; a version
that never comes is a 503 that leaves the server on the weights it has. About 6 s.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import torch
import uvicorn

from asyncrl.config.inference import InferenceConfig
from asyncrl.inference.main import build_server_app
from asyncrl.model import Transformer, from_pretrained, save_pretrained
from asyncrl.model.serving import serving_format
from asyncrl.tools.init_model import init_model
from asyncrl.weight_transfer import BucketSender, SendLoop, host_store, iter_shards
from helpers import free_port


@contextlib.contextmanager
def _server(model_dir: Path, store_port: int) -> Iterator[tuple[httpx.Client, object]]:
    cfg = InferenceConfig(
        model=str(model_dir),
        port=free_port(),
        device="cpu",
        kv_cache_tokens=4096,
        log_level="warning",
        weights={"transport": "distributed", "endpoint": f"127.0.0.1:{store_port}", "timeout_s": 3},
        weights_server="s0",
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
        with httpx.Client(base_url=f"http://127.0.0.1:{cfg.port}", timeout=60) as client:
            yield client, app.state.server.engine
    finally:
        srv.should_exit = True
        thread.join(timeout=30)


def _step(model: Transformer) -> None:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05 * p.abs())


def _wait_for(cond, what: str) -> None:
    deadline = time.monotonic() + 60
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_version_received_is_swapped_in_between_steps_as_its_files_would_be(tmp_path):
    init_model("tiny-moe", tmp_path / "model", seed=0)
    model = from_pretrained(tmp_path / "model")
    fmt = serving_format(model, torch.float32)
    store_port = free_port()
    loop = SendLoop(
        host_store(store_port, num_senders=1),
        rank=0,
        world_size=1,
        sender=BucketSender(bucket_bytes=1 << 20, delta=True),
        timeout_s=30,
        initial=(0, list(iter_shards(model, fmt))),
    )
    loop.start()
    with _server(tmp_path / "model", store_port) as (client, engine):
        request = {"prompt_token_ids": [5, 6, 7, 8], "max_tokens": 48, "ignore_eos": True, "temperature": 1.0}
        answer: dict = {}
        worker = threading.Thread(
            target=lambda: answer.update(client.post("/v1/generate", json=request).json())
        )
        worker.start()
        _wait_for(lambda: engine.engine.num_generated_tokens >= 4, "the request never started")
        assert client.post("/pause", json={"mode": "keep"}).status_code == 200  # hold it mid-way
        _step(model)
        loop.submit(1, list(iter_shards(model, fmt)))
        loop.wait(1, timeout_s=30)
        update = {"path": "unused", "version": 1, "transport": "distributed"}
        got = client.post("/update_weights", json=update)
        assert got.status_code == 200, got.text
        body = got.json()
        assert body["version"] == 1 and body["receive_seconds"] is not None and body["paused_seconds"] >= 0
        assert client.post("/resume").status_code == 200
        worker.join(timeout=60)
        versions = answer["policy_versions"]
        n_old = versions.count(0)
        assert 4 <= n_old < 48 and versions == [0] * n_old + [1] * (48 - n_old)
        assert answer["context_version"] == 0  # its later tokens attended over the KV v0 computed
        assert engine.engine.scheduler.num_preemptions == 0
        save_pretrained(model, tmp_path / "v1")
        on_disk = engine.engine.read_weights(str(tmp_path / "v1"))
        served = engine.engine.model.state_dict()
        assert all(torch.equal(served[k], v) for k, v in on_disk.items())
        assert client.get("/weights").json()["version"] == 1
        missing = client.post("/update_weights", json=update | {"version": 2})
        assert missing.status_code == 503
        assert "did not receive version >= 2 within 3 s (it holds 1" in missing.text
        assert client.get("/weights").json()["version"] == 1
    loop.close()
