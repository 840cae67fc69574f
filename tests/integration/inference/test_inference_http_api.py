"""/v1/generate, admin and metrics endpoints of the live server; bad input; disconnects; weight updates.

Tests run in file order: the weight-update tests come last because they change the served weights.
"""

import asyncio
import threading
import time

import httpx
import numpy as np
import pytest
import torch

from asyncrl.model import from_pretrained, save_pretrained
from asyncrl.wire import GenerateResponse
from weight_update_reference import kept_kv_logprobs, perturb_all_weights


def _metric(client: httpx.Client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"metric {name} missing")


def _teacher(model, prompt, tokens, temperature=1.0, **kw):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens]), **kw).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def _generate(client, **body) -> GenerateResponse:
    r = client.post("/v1/generate", json=body)
    assert r.status_code == 200, r.text
    return GenerateResponse.model_validate(r.json())


def test_generate_logprobs_routing_and_versions(server):
    model = from_pretrained(server.model_dir)
    prompt = list(range(40, 70))
    with server.client() as c:
        version = c.get("/weights").json()["version"]
        out = _generate(
            c,
            prompt_token_ids=prompt,
            max_tokens=10,
            seed=3,
            ignore_eos=True,
            return_routed_experts=True,
            temperature=0.8,
        )
    assert out.policy_versions == [version] * 10 and out.finish_reason == "length"
    assert out.context_version == version
    lp = torch.tensor(out.logprobs)
    assert (_teacher(model, prompt, out.token_ids, 0.8) - lp).abs().max() <= 1e-5
    routing = out.routed_experts.to_array()
    a = model.args
    assert routing.dtype == np.uint8 and routing.shape == (40, a.num_hidden_layers, a.num_experts_per_tok)
    replay = torch.from_numpy(routing.astype(np.int64))[None]
    assert (_teacher(model, prompt, out.token_ids, 0.8, routed_experts=replay) - lp).abs().max() <= 1e-5


def test_prefix_cache_and_salt(server):
    prompt = list(range(100, 140))  # two full 16-token blocks before the last prompt token
    with server.client() as c:
        first = _generate(c, prompt_token_ids=prompt, max_tokens=2, cache_salt="s0")
        again = _generate(
            c,
            prompt_token_ids=prompt,
            max_tokens=2,
            cache_salt="s0",
            return_routed_experts=True,
            routed_experts_start=30,
        )
        other = _generate(c, prompt_token_ids=prompt, max_tokens=2, cache_salt="s1")
        assert _metric(c, "asyncrl_prefix_cache_hit_rate") > 0
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 32 and other.num_cached_tokens == 0
    assert again.routed_experts.start == 30 and again.routed_experts.shape[0] == 40 + 2 - 30


BAD_INPUTS = [
    ("/v1/generate", {"prompt_token_ids": [1], "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/generate", {"prompt_token_ids": [1], "max_tokens": 10**9}, 400, "max_tokens"),
    ("/v1/generate", {"prompt_token_ids": [1], "max_tokens": 4096}, 400, "max_tokens"),
    ("/v1/generate", {"prompt_token_ids": [1, 100000]}, 400, "prompt_token_ids"),
    ("/v1/generate", {"prompt_token_ids": [1] * 5000}, 400, "prompt_token_ids"),
    ("/v1/generate", {"prompt_token_ids": []}, 400, "prompt_token_ids"),
    ("/v1/generate", {"max_tokens": 3}, 400, "prompt_token_ids"),
    ("/v1/generate", {"prompt_token_ids": [1], "temperature": -1}, 400, "temperature"),
    ("/v1/generate", {"prompt_token_ids": [1], "bogus": 1}, 400, "bogus"),
    ("/v1/completions", {"model": "MODEL", "prompt": "x" * 5000}, 400, "prompt"),
    ("/v1/completions", {"model": "MODEL", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": "other", "prompt": "x"}, 404, "model"),
    ("/v1/chat/completions", {"model": "MODEL", "messages": [{"content": "x"}]}, 400, "messages.0.role"),
    ("/update_weights", {"path": "/does/not/exist", "version": 1}, 400, "path"),
    ("/pause", {"mode": "later"}, 400, "mode"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_INPUTS)
def test_bad_input_gets_4xx_naming_the_field(server, path, body, status, param):
    if body.get("model") == "MODEL":
        body = body | {"model": server.name}
    with server.client() as c:
        r = c.post(path, json=body)
        assert r.status_code == status, r.text
        assert r.json()["error"]["param"] == param
        assert c.get("/health").json() == {"status": "ok", "paused": False}
        assert len(_generate(c, prompt_token_ids=[1, 2], max_tokens=2, ignore_eos=True).token_ids) == 2


def test_malformed_json_and_wrong_key(server):
    with server.client() as c:
        r = c.post(
            "/v1/generate", content=b'{"prompt_token_ids": [1,', headers={"content-type": "application/json"}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    r = httpx.post(
        f"{server.url}/v1/generate", json={"prompt_token_ids": [1]}, headers={"Authorization": "Bearer x"}
    )
    assert r.status_code == 401 and r.json()["error"]["param"] == "Authorization"
    assert httpx.get(f"{server.url}/health").status_code == 200  # open without a key


def test_client_disconnect_frees_its_request(server):
    with server.client() as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post(
                "/v1/generate",
                json={"prompt_token_ids": [1, 2, 3], "max_tokens": 4000, "ignore_eos": True},
                timeout=1.0,
            )
        deadline = time.monotonic() + 8  # generating 4000 tokens takes far longer
        while _metric(c, "asyncrl_requests_running") > 0:
            assert time.monotonic() < deadline, "the abandoned request was not freed"
            time.sleep(0.1)
        assert _metric(c, "asyncrl_kv_blocks_used") == 0


def test_streaming_client_disconnect_frees_its_request(server):
    body = {"model": server.name, "prompt": "abc", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with server.client() as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            next(r.iter_lines())
        deadline = time.monotonic() + 8  # generating 4000 tokens takes far longer
        while _metric(c, "asyncrl_requests_running") > 0:
            assert time.monotonic() < deadline, "the abandoned stream was not freed"
            time.sleep(0.1)


def test_metrics_exports_the_required_series(server):
    with server.client() as c:
        text = c.get("/metrics").text
    for name in (
        "requests_running",
        "requests_waiting",
        "kv_blocks_used",
        "kv_blocks_free",
        "prefix_cache_hit_rate",
        "generated_tokens_total",
        "weight_version",
    ):
        assert f"\nasyncrl_{name} " in text


def _start_long_request(server, results: dict, max_tokens: int) -> threading.Thread:
    def run():
        with server.client() as c:
            results["out"] = _generate(
                c, prompt_token_ids=list(range(10, 30)), max_tokens=max_tokens, ignore_eos=True, seed=11
            )

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _wait_for_tokens(c, baseline: float, n: int) -> None:
    deadline = time.monotonic() + 30
    while _metric(c, "asyncrl_generated_tokens_total") < baseline + n:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_update_weights_keep_mid_generation(server, tmp_path):
    old = from_pretrained(server.model_dir)
    new = perturb_all_weights(old, seed=0, scale=0.1)  # every weight: the kept KV is now stale
    save_pretrained(new, tmp_path / "step_1")
    results: dict = {}
    with server.client() as c:
        v0 = c.get("/weights").json()["version"]
        baseline = _metric(c, "asyncrl_generated_tokens_total")
        thread = _start_long_request(server, results, max_tokens=400)
        _wait_for_tokens(c, baseline, 5)
        r = c.post("/update_weights", json={"path": str(tmp_path / "step_1"), "version": v0 + 1})
        assert r.status_code == 200, r.text
        assert r.json()["version"] == v0 + 1 and r.json()["paused_seconds"] >= 0
        thread.join(timeout=120)
        assert c.get("/weights").json()["version"] == v0 + 1
    out = results["out"]
    n_old = out.policy_versions.count(v0)
    assert 1 < n_old < 400 and out.policy_versions == [v0] * n_old + [v0 + 1] * (400 - n_old)
    assert out.context_version == v0  # its later tokens attended over KV that v0 computed
    prompt, tokens, lp = list(range(10, 30)), out.token_ids, torch.tensor(out.logprobs)
    assert (_teacher(old, prompt, tokens)[:n_old] - lp[:n_old]).abs().max() <= 1e-5
    # After the update: the new weights on top of the KV the old ones computed, not a recompute.
    kept = kept_kv_logprobs(old, new, prompt, tokens, n_old, 1.0)
    assert (kept - lp[n_old:]).abs().max() <= 1e-5
    assert (_teacher(new, prompt, tokens)[n_old:] - lp[n_old:]).abs().max() > 1e-3, "the old KV must matter"
    assert (_teacher(old, prompt, tokens)[n_old:] - lp[n_old:]).abs().max() > 1e-3


def test_update_weights_abort_and_pause_resume(server):
    results: dict = {}
    with server.client() as c:
        v = c.get("/weights").json()["version"]
        baseline = _metric(c, "asyncrl_generated_tokens_total")
        thread = _start_long_request(server, results, max_tokens=3000)
        _wait_for_tokens(c, baseline, 3)
        r = c.post("/update_weights", json={"path": str(server.model_dir), "version": v + 1, "mode": "abort"})
        assert r.status_code == 200, r.text
        thread.join(timeout=60)
        out = results["out"]
        assert out.finish_reason == "abort" and 0 < len(out.token_ids) < 3000
        assert c.post("/pause", json={"mode": "keep"}).json()["paused"] is True
        thread = _start_long_request(server, results, max_tokens=4)
        time.sleep(0.5)
        assert _metric(c, "asyncrl_paused") == 1 and _metric(c, "asyncrl_requests_waiting") == 1
        assert c.get("/health").json() == {"status": "ok", "paused": True}
        c.post("/resume")
        assert c.get("/health").json() == {"status": "ok", "paused": False}
        thread.join(timeout=60)
        assert results["out"].policy_versions == [v + 1] * 4


def test_load_500_requests_at_concurrency_64(server):
    async def main() -> list[int]:
        sem = asyncio.Semaphore(64)
        rng = np.random.default_rng(0)
        headers = {"Authorization": f"Bearer {server.api_key}"}
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=60) as c:

            async def one(i: int) -> int:
                async with sem:
                    n = int(rng.integers(1, 9))
                    if i % 2:
                        body = {
                            "model": server.name,
                            "prompt": f"req {i}",
                            "max_tokens": n,
                            "ignore_eos": True,
                        }
                        return (await c.post("/v1/completions", json=body)).status_code
                    body = {"prompt_token_ids": [257, *range(i % 50, i % 50 + 8)], "max_tokens": n}
                    return (await c.post("/v1/generate", json=body)).status_code

            return await asyncio.gather(*(one(i) for i in range(500)))

    codes = asyncio.run(asyncio.wait_for(main(), timeout=150))
    assert codes.count(200) == 500
    with server.client() as c:
        assert c.get("/health").json() == {"status": "ok", "paused": False}
        assert _metric(c, "asyncrl_requests_running") == 0 and _metric(c, "asyncrl_kv_blocks_used") == 0
