from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from asyncrl.model.tokenizer import save_byte_tokenizer
from asyncrl.run_dir import batch_dir
from asyncrl.transport.rollouts import read_batch
from asyncrl.transport.weights import stage_weights

from .fake_server import FakeServer


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    save_byte_tokenizer(path)
    return path


@pytest.fixture
def servers():
    started: list[FakeServer] = []

    def make(n: int = 1, **kw) -> list[FakeServer]:
        for i in range(n):
            started.append(FakeServer(seed=i, **kw).start())
        return started[-n:]

    yield make
    for s in started:
        s.stop()


async def fake_trainer(
    run_dir: Path, max_steps: int, seen: list, step_time_s: float = 0.05, keep_last: int | None = None
) -> None:
    """Consume rollouts/step_n as they appear and publish weights/step_n (no real training), pruning
    as the trainer does with `keep_last`."""
    for step in range(1, max_steps + 1):
        while not batch_dir(run_dir, step).is_dir():
            await asyncio.sleep(0.01)
        seen.append(read_batch(run_dir, step, timeout_s=1))
        await asyncio.sleep(step_time_s)
        with stage_weights(run_dir, step, keep_last=keep_last) as tmp:
            (tmp / "config.json").write_text("{}")
