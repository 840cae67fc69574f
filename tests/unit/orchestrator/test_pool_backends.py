"""The pool routes over any `InferenceBackend`: an in-process one, without HTTP, plugs in unchanged."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.client import InferenceBackend, InferenceError, ServerUnavailable
from asyncrl.orchestrator.pool import ServerPool
from asyncrl.orchestrator.weights import WeightUpdater
from asyncrl.transport.weights import stage_weights
from asyncrl.wire import (
    GenerateRequest,
    GenerateResponse,
    PauseRequest,
    PauseResponse,
    ResumeResponse,
    SamplingParams,
    UpdateWeightsRequest,
    UpdateWeightsResponse,
    WeightsInfo,
)


class MemoryBackend:
    """Echoes the prompt's last token; `fail` makes generate raise that error."""

    def __init__(self, url: str) -> None:
        self.url, self.version, self.calls, self.fail = url, 0, [], None

    async def generate(self, request: GenerateRequest) -> GenerateResponse:
        self.calls.append("generate")
        await asyncio.sleep(0)  # in flight across a scheduling point, as a real request is
        if self.fail is not None:
            raise self.fail
        tok = request.prompt_token_ids[-1]
        return GenerateResponse(
            token_ids=[tok], logprobs=[0.0], policy_versions=[self.version], finish_reason="stop"
        )

    async def pause(self, request: PauseRequest) -> PauseResponse:
        self.calls.append(f"pause:{request.mode}")
        return PauseResponse(paused=True, mode=request.mode, num_aborted=0)

    async def resume(self) -> ResumeResponse:
        self.calls.append("resume")
        return ResumeResponse(paused=False)

    async def update_weights(self, request: UpdateWeightsRequest) -> UpdateWeightsResponse:
        self.calls.append(f"update:{request.version}")
        self.version = request.version
        return UpdateWeightsResponse(version=request.version, load_seconds=0.0, paused_seconds=0.0)

    async def weights(self) -> WeightsInfo:
        return WeightsInfo(version=self.version)

    async def health(self, timeout_s: float) -> bool:
        return self.fail is None

    async def metrics(self) -> str:
        return ""

    async def aclose(self) -> None:
        self.calls.append("close")


def test_sessions_stick_and_failures_take_a_backend_out_of_rotation():
    a, b = MemoryBackend("mem://a"), MemoryBackend("mem://b")
    assert isinstance(a, InferenceBackend)
    pool = ServerPool([a, b])

    async def go():
        s1, s2 = pool.session("e1"), pool.session("e2")
        out, _ = await asyncio.gather(  # least-loaded: the second session goes to the idle server
            s1.generate([4, 9], SamplingParams()), s2.generate([1], SamplingParams())
        )
        await s1.generate([4, 9, 9, 5], SamplingParams())
        return out

    out = asyncio.run(go())
    assert out.token_ids == [9] and out.policy_versions == [0]
    assert a.calls == ["generate", "generate"] and b.calls == ["generate"]  # e1 stays on a
    assert pool.stats.requests == 3 and pool.stats.prompt_tokens == 7

    a.fail = ServerUnavailable("mem://a down")
    with pytest.raises(ServerUnavailable, match="mem://a down"):
        asyncio.run(pool.session("e1").generate([1], SamplingParams()))
    assert [s.url for s in pool.healthy_servers] == ["mem://b"]

    b.fail = InferenceError("bad request")  # the request's fault: the server stays in rotation
    with pytest.raises(InferenceError, match="bad request"):
        asyncio.run(pool.session("e3").generate([1], SamplingParams()))
    assert [s.url for s in pool.healthy_servers] == ["mem://b"]


def test_an_uncounted_session_is_routed_like_the_others_but_left_out_of_the_stats():
    a, b = MemoryBackend("mem://a"), MemoryBackend("mem://b")
    pool = ServerPool([a, b])

    async def go():
        train, ev = pool.session("train/0"), pool.session("eval/0", cache_salt=lambda: "3", count=False)
        await asyncio.gather(
            train.generate([4, 9], SamplingParams()), ev.generate([1, 2, 3], SamplingParams())
        )
        await ev.generate([1, 2, 3, 7], SamplingParams())

    asyncio.run(go())
    assert a.calls == ["generate"] and b.calls == ["generate", "generate"]  # least-loaded, then sticky
    assert pool.stats.requests == 1 and pool.stats.prompt_tokens == 2 and pool.stats.generated_tokens == 1


def test_weight_updates_go_through_the_backend_seam(tmp_path):
    a, b = MemoryBackend("mem://a"), MemoryBackend("mem://b")
    pool = ServerPool([a, b])
    with stage_weights(tmp_path, 2) as tmp:
        (tmp / "config.json").write_text("{}")
    seen: list[int] = []
    updater = WeightUpdater(pool, tmp_path, on_version=seen.append)

    assert asyncio.run(updater.sync_once()) is True
    assert seen == [2] and a.version == b.version == 2
    assert a.calls == ["update:2"]  # the backend pauses itself only for as long as it must

    c = MemoryBackend("mem://c")  # a restarted server at v0 is brought to v2 before re-admission
    assert asyncio.run(updater.sync_server(ServerPool([c]).servers[0])) is True
    assert c.version == 2
    asyncio.run(pool.aclose())
    assert a.calls[-1] == "close" and b.calls[-1] == "close"
