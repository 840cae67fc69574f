"""Torch threads of an `AsyncEngine`: the engine thread computes with the process's count, the
thread that loaded the engine is gone (with its OpenMP pool), and helper threads run on one, so
that the engine's pool is the only one (asyncrl.inference.async_engine's docstring: with more
pooled threads than cores, OpenMP puts its workers to sleep between ops).
"""

from __future__ import annotations

import asyncio
import threading

import torch

from asyncrl.config.inference import InferenceConfig
from asyncrl.inference import SamplingOptions
from asyncrl.inference.async_engine import AsyncEngine, on_one_torch_thread
from asyncrl.tools.init_model import init_model


def test_the_engine_thread_keeps_the_callers_thread_count_and_helpers_run_on_one(tmp_path):
    init_model("tiny-moe", tmp_path / "model", seed=0)
    config = InferenceConfig(model=str(tmp_path / "model"), device="cpu", kv_cache_tokens=4096)
    before = torch.get_num_threads()
    torch.set_num_threads(3)  # not what OMP_NUM_THREADS says: a new thread would start from that
    try:
        driver = AsyncEngine.load(config)
        assert not [t for t in threading.enumerate() if t.name.startswith("asyncrl-load")]

        async def run() -> tuple[int, int, list[int]]:
            driver.start()
            try:
                engine_threads = await driver.call(torch.get_num_threads)
                helper_threads = await asyncio.to_thread(on_one_torch_thread(torch.get_num_threads))
                options = SamplingOptions(temperature=0.0, max_tokens=4, ignore_eos=True)
                outs = [out async for out in driver.generate("r", [1, 2, 3], options)]
                return engine_threads, helper_threads, [t for out in outs for t in out.new_token_ids]
            finally:
                driver.stop()

        engine_threads, helper_threads, tokens = asyncio.run(run())
        assert (engine_threads, helper_threads, driver.torch_threads) == (3, 1, 3)
        assert len(tokens) == 4
        assert torch.get_num_threads() == 3  # the caller's own count is left alone
    finally:
        torch.set_num_threads(before)
