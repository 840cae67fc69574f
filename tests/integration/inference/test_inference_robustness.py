"""A live server under hostile input: 4xx naming the field on every endpoint, atomic weight updates,
bounded bodies, weight roots, and good requests unaffected by bad ones running beside them."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading

import httpx
import pytest
from safetensors.torch import load_file, save_file

from asyncrl.model.hf import from_pretrained, save_pretrained

S = "\ud800"  # a lone surrogate: valid JSON ("\\ud800"), not valid Unicode
BAD = [
    ("/v1/completions", {"prompt": f"a{S}b"}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "seed": -1}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "seed": 2**64}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "temperature": 1e-30}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "stop": [str(i) for i in range(17)]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": "y" * 1000}, 400, "stop"),
    ("/v1/completions", {"prompt": "x" * 60000}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": S}]}, 400, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "seed": 2**63}, 400, "seed"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "temperature": 1e-9},
        400,
        "temperature",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 17},
        400,
        "stop",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"},
        403,
        "chat_template",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "x"}],
            "chat_template_kwargs": {"chat_template": "{% for i in range(99999) %}{% endfor %}"},
        },
        400,
        "chat_template_kwargs.chat_template",
    ),
    ("/v1/generate", {"prompt_token_ids": [1], "cache_salt": S}, 400, "cache_salt"),
    ("/v1/generate", {"prompt_token_ids": [1], "stop": [S]}, 400, "stop.0"),
    ("/v1/generate", {"prompt_token_ids": [1], "seed": 2**64}, 400, "seed"),
    ("/v1/generate", {"prompt_token_ids": [1], "seed": -5}, 400, "seed"),
    ("/v1/generate", {"prompt_token_ids": [1], "temperature": 1e-300}, 400, "temperature"),
    ("/v1/generate", {"prompt_token_ids": [1], "stop": ["z" * 300]}, 400, "stop"),
    ("/v1/generate", {"prompt_token_ids": [1], "stop_token_ids": [1] * 300}, 400, "stop_token_ids"),
    ("/v1/generate", {"prompt_token_ids": [1] * 40000}, 413, "body"),
    ("/update_weights", {"path": f"/tmp/{S}", "version": 1}, 400, "path"),
    ("/update_weights", {"path": "ROOT/a\x00b", "version": 1}, 400, "path"),
    ("/update_weights", {"path": "/etc", "version": 1}, 403, "path"),
    ("/update_weights", {"path": "ROOT/../..", "version": 1}, 403, "path"),
    ("/update_weights", {"path": "ROOT/missing", "version": 1}, 400, "path"),
    ("/update_weights", {"path": "ROOT", "version": 2**40}, 400, "version"),
]


def _json(body: dict) -> dict:
    """httpx keyword arguments sending `body` as ASCII JSON (escapes lone surrogates as JSON allows)."""
    return {"content": json.dumps(body), "headers": {"content-type": "application/json"}}


def _body(server, body: dict) -> dict:
    if "messages" in body or "prompt" in body:
        body = {"model": server.name} | body
    if isinstance(body.get("path"), str):
        body = body | {"path": body["path"].replace("ROOT", str(server.roots))}
    return body


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD)
def test_malformed_input_is_a_4xx_naming_the_field_and_keeps_the_connection(
    hardened, path, body, status, param
):
    with hardened.client() as c:
        assert c.get("/health").status_code == 200
        r = c.post(path, **_json(_body(hardened, body)))
        assert r.status_code == status, r.text
        assert r.json()["error"]["param"] == param, r.text
        assert r.headers.get("connection") != "close"
        ok = c.post("/v1/generate", json={"prompt_token_ids": [1, 2], "max_tokens": 2, "ignore_eos": True})
        assert ok.status_code == 200 and len(ok.json()["token_ids"]) == 2


def test_bearer_scheme_is_case_insensitive(hardened):
    for scheme in ("Bearer", "bearer", "BEARER"):
        r = httpx.get(f"{hardened.url}/weights", headers={"Authorization": f"{scheme} {hardened.api_key}"})
        assert r.status_code == 200, scheme
    key = hardened.api_key
    for header in (f"Basic {key}", key, f"Bearer {key}x", "Bearer"):
        assert httpx.get(f"{hardened.url}/weights", headers={"Authorization": header}).status_code == 401


def _greedy(c: httpx.Client, prompt: list[int]) -> list[int]:
    r = c.post(
        "/v1/generate",
        json={"prompt_token_ids": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    return r.json()["token_ids"]


@pytest.mark.parametrize("fault", ["shape", "truncated", "extra"])
def test_a_rejected_weight_update_leaves_the_served_weights_and_version(hardened, fault):
    ckpt = hardened.roots / f"bad_{fault}"
    model = from_pretrained(hardened.model_dir)
    save_pretrained(model, ckpt)
    file = ckpt / "model.safetensors"
    if fault == "truncated":
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    else:
        state = {k: v + 1.0 for k, v in load_file(file).items()}  # every tensor differs ...
        last = sorted(state)[-1]
        if fault == "shape":
            state[last] = state[last][..., :-1]  # ... and the last one is mis-shaped
        else:
            state["model.layers.0.bogus.weight"] = state[last].clone()
        save_file(state, file)
    prompt = list(range(3, 13))
    with hardened.client() as c:
        version, before = c.get("/weights").json()["version"], _greedy(c, prompt)
        r = c.post("/update_weights", json={"path": str(ckpt), "version": version + 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "path", r.text
        if fault == "truncated":
            assert "model.safetensors" in r.json()["error"]["message"]
        assert c.get("/weights").json()["version"] == version and _greedy(c, prompt) == before
    for name, p in hardened.app.state.server.engine.engine.model.named_parameters():
        assert p.detach().equal(dict(model.named_parameters())[name].detach()), name


def test_good_requests_are_unaffected_by_bad_ones_beside_them(hardened):
    """Greedy outputs of good requests are identical with and without a concurrent load of bad ones."""
    good = [[257, *range(i, i + 6)] for i in range(12)]
    bad = [_body(hardened, {"path": p, **b}) | {"_path": p} for p, b, *_ in BAD[:-6]] * 2

    async def run(with_bad: bool) -> list[list[int]]:
        headers = {"Authorization": f"Bearer {hardened.api_key}"}
        async with httpx.AsyncClient(base_url=hardened.url, headers=headers, timeout=120) as c:

            async def one_good(prompt: list[int]) -> list[int]:
                body = {"prompt_token_ids": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
                r = await c.post("/v1/generate", json=body)
                assert r.status_code == 200, r.text
                return r.json()["token_ids"]

            async def one_bad(body: dict) -> int:
                path = body.pop("_path")
                return (await c.post(path, **_json(body))).status_code

            tasks = [asyncio.create_task(one_good(p)) for p in good]
            statuses = await asyncio.gather(*(one_bad(dict(b)) for b in bad)) if with_bad else []
            assert all(400 <= s < 500 for s in statuses), statuses
            return list(await asyncio.gather(*tasks))

    alone = asyncio.run(run(with_bad=False))
    assert asyncio.run(run(with_bad=True)) == alone
    with hardened.client() as c:
        text = c.get("/metrics").text
    assert "asyncrl_request_errors_total 0" in text and "asyncrl_engine_step_errors_total 0" in text


class _BlockingTokenizer:
    """The server's tokenizer, except that encoding the marker text blocks until released."""

    MARKER = "tokenize-me-slowly"

    def __init__(self, inner) -> None:
        self.inner, self.entered, self.release = inner, threading.Event(), threading.Event()

    def encode(self, text, **kw):
        if self.MARKER in text:
            self.entered.set()
            self.release.wait(
                timeout=30
            )  # bounded, so an on-loop tokenizer fails the test instead of hanging it
        return self.inner.encode(text, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_health_answers_while_a_prompt_is_being_tokenized(hardened):
    """Tokenization runs off the event loop: while one request's prompt is still being tokenized,
    /health (and a token-id request) are answered. On the loop, both would wait for the tokenizer."""
    state = hardened.app.state.server
    blocking = _BlockingTokenizer(state.tokenizer)
    state.tokenizer = blocking
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool, hardened.client() as c:
            body = {"model": hardened.name, "prompt": blocking.MARKER, "max_tokens": 2}

            def post_slow() -> httpx.Response:
                with hardened.client() as own:
                    return own.post("/v1/completions", json=body)

            slow = pool.submit(post_slow)
            assert blocking.entered.wait(timeout=30), "the slow prompt never reached the tokenizer"
            assert c.get("/health").status_code == 200
            gen = c.post("/v1/generate", json={"prompt_token_ids": [1, 2, 3], "max_tokens": 2})
            assert gen.status_code == 200 and len(gen.json()["token_ids"]) == 2
            assert not blocking.release.is_set() and not slow.done()  # answered while it was blocked
            blocking.release.set()
            assert slow.result(timeout=60).status_code == 200
    finally:
        blocking.release.set()
        state.tokenizer = blocking.inner
