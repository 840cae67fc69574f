"""VLLMBackend: the InferenceBackend seam mapped onto vLLM's endpoints (mock transport, no vLLM)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from asyncrl.client import InferenceBackend, InferenceError, ServerUnavailable, VLLMBackend
from asyncrl.wire import GenerateRequest, PauseRequest, UpdateWeightsRequest


def _generate_answer(body: dict) -> dict:
    n = body["sampling_params"]["max_tokens"]
    return {
        "choices": [
            {
                "index": 0,
                "finish_reason": "length",
                "token_ids": list(range(n)),
                "logprobs": {"content": [{"token_id": i, "logprob": -1.0} for i in range(n)]},
                "weight_versions": [
                    {"version": "default", "start": 0, "end": 1},
                    {"version": "2", "start": 1, "end": n},
                ],
            }
        ]
    }


class FakeVLLM:
    """Records calls; answers as vLLM 0.32 does."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict | None]] = []
        self.label = "default"

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        body = json.loads(request.content) if request.content else None
        self.calls.append(
            (request.method, path + (f"?{request.url.query.decode()}" if request.url.query else ""), body)
        )
        if path == "/inference/v1/generate":
            return httpx.Response(200, json=_generate_answer(body))
        if path == "/update_weight_version":
            self.label = body["new_version"]
            return httpx.Response(200, json={"success": True, "new_version": self.label})
        if path == "/weight_info":
            return httpx.Response(200, json={"weight_version": self.label})
        if path == "/collective_rpc":
            return httpx.Response(200, json={"results": [None]})
        return httpx.Response(200, json={"status": "ok"})


def _backend(handler) -> VLLMBackend:
    return VLLMBackend("http://vllm/", transport=httpx.MockTransport(handler))


def test_generate_speaks_inference_v1_generate():
    fake = FakeVLLM()

    async def go():
        b = _backend(fake)
        assert isinstance(b, InferenceBackend)
        out = await b.generate(GenerateRequest(prompt_token_ids=[3, 4], max_tokens=3, cache_salt="2"))
        await b.aclose()
        return out, b.epoch_key

    out, epoch_key = asyncio.run(go())
    method, path, body = fake.calls[0]
    assert (method, path) == ("POST", "/inference/v1/generate")
    assert body["token_ids"] == [3, 4] and body["cache_salt"] == f"2|{epoch_key}"  # keyed by weights
    assert out.token_ids == [0, 1, 2] and out.policy_versions == [0, 2, 2]
    assert out.context_version == 0  # the backend held v0 (its start) when it sent the request


def test_update_inside_a_pause_reloads_and_labels_the_version():
    fake = FakeVLLM()

    async def go():
        b = _backend(fake)
        await b.pause(PauseRequest(mode="keep"))
        res = await b.update_weights(UpdateWeightsRequest(path="/run/weights/step_5", version=5))
        await b.resume()
        info = await b.weights()
        await b.aclose()
        return res, info

    res, info = asyncio.run(go())
    assert [c[1] for c in fake.calls] == [  # the reload's own pause (keep) starts a new epoch
        "/pause?mode=keep&clear_cache=false",
        "/pause?mode=keep&clear_cache=false",
        "/collective_rpc",
        "/update_weight_version",
        "/resume",
        "/weight_info",
    ]
    assert fake.calls[2][2] == {
        "method": "asyncrl_reload_weights",
        "kwargs": {"weights_path": "/run/weights/step_5"},
    }
    assert fake.calls[3][2] == {"new_version": "5"}
    assert res.version == 5 and res.load_seconds >= 0
    assert info.version == 5


def test_update_outside_a_pause_pauses_around_the_reload():
    fake = FakeVLLM()

    async def go():
        b = _backend(fake)
        await b.update_weights(UpdateWeightsRequest(path="/w", version=1, mode="abort"))
        await b.aclose()

    asyncio.run(go())
    assert [c[1] for c in fake.calls] == [
        "/pause?mode=abort",
        "/collective_rpc",
        "/update_weight_version",
        "/resume",
    ]


def test_errors_are_named_by_kind():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/inference/v1/generate":
            return httpx.Response(400, json={"error": {"message": "token_ids: bad"}})
        if request.url.path == "/weight_info":
            return httpx.Response(200, json={"weight_version": "nightly"})
        return httpx.Response(503, text="engine dead")

    async def go():
        b = _backend(handler)
        with pytest.raises(InferenceError, match="400"):
            await b.generate(GenerateRequest(prompt_token_ids=[1]))
        with pytest.raises(ServerUnavailable, match="503"):
            await b.pause(PauseRequest())
        with pytest.raises(InferenceError, match="nightly"):
            await b.weights()
        await b.aclose()

    asyncio.run(go())


def test_an_answer_outside_the_contract_is_an_inference_error():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"choices": [{"token_ids": [1], "finish_reason": "length"}]})

    async def go():
        b = _backend(handler)
        with pytest.raises(InferenceError, match="breaks the contract"):
            await b.generate(GenerateRequest(prompt_token_ids=[1]))
        await b.aclose()

    asyncio.run(go())


class CachingVLLM:
    """vLLM's behaviour around an update, as far as the prefix cache goes: its cache is keyed by
    `cache_salt` and prompt only (never by weights), a paused server queues new requests until
    `/resume`, and a reload can be held (`reload_gate`) or fail (`fail_reloads`). `hold_next`
    holds the next request before it is scheduled (waiting in vLLM's queue). The cache survives a
    keep-mode pause, as vLLM's does when the backend asks it to (`clear_cache=false`).
    """

    def __init__(self) -> None:
        self.label, self.paths, self.fail_reloads = "default", [], 0
        self.unpaused, self.reload_gate = asyncio.Event(), asyncio.Event()
        self.unpaused.set()
        self.reload_gate.set()
        self.hold_next: asyncio.Event | None = None
        self.blocks: dict[tuple[str | None, tuple[int, ...]], int] = {}  # -> version that computed it
        self.served: list[dict] = []  # per request: salt, KV version served, weights that ran it

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        path, body = request.url.path, json.loads(request.content) if request.content else None
        if path == "/pause":
            self.unpaused.clear()
        elif path == "/resume":
            self.unpaused.set()
        elif path == "/collective_rpc":
            await self.reload_gate.wait()
            if self.fail_reloads:
                self.fail_reloads -= 1
                return httpx.Response(500, text="reload failed: safetensors header is corrupt")
            self.paths.append(body["kwargs"]["weights_path"])
        elif path == "/update_weight_version":
            self.label = body["new_version"]
        elif path == "/weight_info":
            return httpx.Response(200, json={"weight_version": self.label})
        elif path == "/inference/v1/generate":
            return await self._generate(body)
        return httpx.Response(200, json={"status": "ok"})

    async def _generate(self, body: dict) -> httpx.Response:
        hold, self.hold_next = self.hold_next, None
        if hold is not None:
            await hold.wait()
        await self.unpaused.wait()
        version = 0 if self.label == "default" else int(self.label)
        key = (body.get("cache_salt"), tuple(body["token_ids"]))
        cached = key in self.blocks
        kv = self.blocks.setdefault(key, version)
        self.served.append({"salt": key[0], "kv": kv, "ran": version})
        answer = _generate_answer(body)
        n = body["sampling_params"]["max_tokens"]
        answer["choices"][0]["weight_versions"] = [{"version": self.label, "start": 0, "end": n}]
        answer["usage"] = {
            "prompt_tokens_details": {"cached_tokens": len(body["token_ids"]) if cached else 0}
        }
        return httpx.Response(200, json=answer)


async def _until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.001)


def test_no_request_sent_once_a_reload_is_under_way_is_served_kv_of_older_weights():
    """The orchestrator's salt names the version the servers held when it sent a request, which
    still names v0 while an update to v1 runs; the backend's epoch keeps such requests apart."""
    fake = CachingVLLM()
    prompt = GenerateRequest(prompt_token_ids=[5, 6, 7], max_tokens=2, cache_salt="0")

    async def go():
        b = _backend(fake)
        await b.generate(prompt)
        warm = await b.generate(prompt)  # one epoch shares its blocks
        old_salt = f"0|{b.epoch_key}"
        fake.hold_next = queued_gate = asyncio.Event()
        queued = asyncio.create_task(b.generate(prompt))  # sent before the update, still waiting
        await _until(lambda: fake.hold_next is None)
        fake.reload_gate.clear()
        update = asyncio.create_task(b.update_weights(UpdateWeightsRequest(path="/w/step_1", version=1)))
        await _until(lambda: not fake.unpaused.is_set())
        during = asyncio.create_task(b.generate(prompt))  # sent while vLLM is paused for the reload
        queued_gate.set()
        await asyncio.sleep(0.01)
        fake.reload_gate.set()
        await update
        after = await b.generate(prompt)
        outs = warm, await queued, await during, after
        await b.aclose()
        return outs, old_salt

    (warm, queued, during, after), old_salt = asyncio.run(go())
    assert warm.num_cached_tokens == 3 and warm.context_version == 0
    # Sent before the update: vLLM may serve it the v0 blocks of its epoch; it says so.
    assert queued.policy_versions == [1, 1] and queued.context_version == 0
    # Sent during the reload's pause: a fresh epoch, computed by v1 only. It was sent while the
    # server held v0, so its context floor stays 0 (conservative).
    assert during.num_cached_tokens == 0 and during.context_version == 0
    # After the update: it shares the blocks v1 computed, and only those.
    assert after.num_cached_tokens == 3 and after.context_version == 1
    older_kv = [r["salt"] for r in fake.served if r["kv"] < r["ran"]]
    assert older_kv == [old_salt]  # the request sent before the update, and only that one


def test_the_epoch_key_differs_between_backends_and_is_the_whole_salt_of_an_unsalted_request():
    fake = FakeVLLM()

    async def go():
        a, b = _backend(fake), _backend(fake)  # e.g. an orchestrator and the one restarted after it
        await a.generate(GenerateRequest(prompt_token_ids=[1], max_tokens=1))
        await b.generate(GenerateRequest(prompt_token_ids=[1], max_tokens=1))
        await a.aclose()
        await b.aclose()
        return a.epoch_key, b.epoch_key

    key_a, key_b = asyncio.run(go())
    assert key_a != key_b
    assert [c[2]["cache_salt"] for c in fake.calls] == [key_a, key_b]


def test_a_failed_reload_raises_and_leaves_the_server_paused():
    fake = CachingVLLM()
    fake.fail_reloads = 1

    async def go():
        b = _backend(fake)
        with pytest.raises(ServerUnavailable, match="corrupt"):
            await b.update_weights(UpdateWeightsRequest(path="/w/step_1", version=1))
        paused_after_failure = not fake.unpaused.is_set()
        held = (await b.weights()).version
        # the rejoin (WeightUpdater.sync_server): a successful update inside the pause, then resume
        await b.update_weights(UpdateWeightsRequest(path="/w/step_1", version=1))
        paused_after_retry = not fake.unpaused.is_set()
        await b.resume()
        out = await b.generate(GenerateRequest(prompt_token_ids=[1], max_tokens=1))
        await b.aclose()
        return paused_after_failure, held, paused_after_retry, out

    paused_after_failure, held, paused_after_retry, out = asyncio.run(go())
    assert paused_after_failure and held == 0  # never resumed on half-loaded weights
    assert paused_after_retry  # the caller's pause: the caller resumes
    assert fake.paths == ["/w/step_1"] and out.policy_versions == [1] and out.context_version == 1


class ReceivingVLLM(FakeVLLM):
    """A vLLM whose workers receive versions over asyncrl's channel: `arrivals` is what the staged
    version reads at each poll (the last one repeats)."""

    def __init__(self, arrivals: list[int | None], *, workers: int = 1, timeout_s: float = 30.0) -> None:
        super().__init__()
        self.arrivals, self.workers, self.timeout_s = arrivals, workers, timeout_s
        self.polls = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path != "/collective_rpc":
            return super().__call__(request)
        body = json.loads(request.content)
        self.calls.append(("POST", "/collective_rpc", body))
        if body["method"] == "asyncrl_staged":
            held = self.arrivals[min(self.polls, len(self.arrivals) - 1)]
            self.polls += 1
            return httpx.Response(
                200, json={"results": [{"version": held, "timeout_s": self.timeout_s}] * self.workers}
            )
        assert body["method"] == "asyncrl_swap_weights"
        swapped = {"version": float(self.arrivals[-1]), "wait_s": 0.0, "load_s": 0.04, "receive_s": 0.3}
        return httpx.Response(200, json={"results": [swapped] * self.workers})


def test_a_distributed_update_waits_serving_for_the_version_then_swaps_it_inside_a_pause():
    fake = ReceivingVLLM([None, 2, 4], workers=2)  # the trainer ran ahead: v4 is staged when v3 is asked

    async def go():
        b = _backend(fake)
        req = UpdateWeightsRequest(path="/run/weights/step_3", version=3, transport="distributed")
        res = await b.update_weights(req)
        await b.aclose()
        return res

    res = asyncio.run(go())
    paths = [c[1] for c in fake.calls]
    # no pause while the version is on its way; the swap, its label and the resume inside one
    assert paths == [
        "/collective_rpc",
        "/collective_rpc",
        "/collective_rpc",
        "/pause?mode=keep&clear_cache=false",
        "/collective_rpc",
        "/update_weight_version",
        "/resume",
    ]
    assert [c[2]["method"] for c in fake.calls if c[1] == "/collective_rpc"] == ["asyncrl_staged"] * 3 + [
        "asyncrl_swap_weights"
    ]
    assert fake.calls[4][2]["kwargs"] == {"version": 3}
    assert fake.calls[5][2] == {"new_version": "4"}  # labelled with what was loaded
    assert res.version == 4 and res.receive_seconds == 0.3 and res.load_seconds >= res.paused_seconds > 0


def test_a_version_that_never_arrives_raises_without_pausing():
    fake = ReceivingVLLM([1], timeout_s=0.2)

    async def go():
        b = _backend(fake)
        with pytest.raises(
            ServerUnavailable, match=r"version 2 did not arrive .* within 0.2 s \(the workers hold \[1\]\)"
        ):
            await b.update_weights(UpdateWeightsRequest(path="/w/step_2", version=2, transport="distributed"))
        await b.aclose()

    asyncio.run(go())
    assert {c[1] for c in fake.calls} == {"/collective_rpc"}  # polled only: serving, weights untouched
