"""Drives an `Engine` from a background thread so that an asyncio server can share it.

The engine thread owns the engine: it drains a command queue (add, abort, pause, weight swap),
then runs one `step()`, and hands each RequestOutput to the asyncio side through the event loop.
Coroutines submit work with `call()` and read a request's outputs from its own asyncio.Queue.

Torch threads: the engine thread runs the model with the process's torch thread count; any other
thread that runs torch ops for it (a checkpoint read, a dtype conversion) runs them on one. OpenMP
keeps a pool of worker threads per thread that has run a parallel op, and once the pools together
hold more threads than the machine has cores, its workers stop spinning between ops and sleep, so
every op of the engine pays a wake-up (a decode step runs thousands of ops). So
`AsyncEngine.load` builds the engine in a thread that ends (its pool goes with it), and the helpers
below keep other threads from making pools of their own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import torch

from asyncrl.config.inference import InferenceConfig
from asyncrl.inference.engine import Engine
from asyncrl.inference.request import RequestFailedError, RequestOutput, SamplingOptions

__all__ = ["AsyncEngine", "on_one_torch_thread"]

log = logging.getLogger(__name__)

T = TypeVar("T")


def on_one_torch_thread(fn: Callable[..., T]) -> Callable[..., T]:
    """`fn` for a helper thread (`asyncio.to_thread`): its torch ops run on that thread alone, so that
    the thread makes no OpenMP pool beside the engine's (module docstring)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> T:
        torch.set_num_threads(1)  # per thread: the engine thread keeps its own count
        return fn(*args, **kwargs)

    return run


class AsyncEngine:
    def __init__(self, engine: Engine, torch_threads: int | None = None) -> None:
        """`torch_threads`: the engine thread's torch thread count (None: the process's, as torch
        reads it from OMP_NUM_THREADS or the cores)."""
        self.engine = engine
        self.torch_threads = torch_threads or torch.get_num_threads()
        self.paused = False
        self.weights_path: str | None = None
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], asyncio.Future | None]] = (
            queue.SimpleQueue()
        )
        self._streams: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.num_step_errors = 0

    @classmethod
    def load(cls, config: InferenceConfig, **engine_kwargs: Any) -> AsyncEngine:
        """`Engine.from_config` in a thread of its own that ends once the engine is built, so that the
        caller's thread makes no OpenMP pool by loading (module docstring)."""
        threads = torch.get_num_threads()

        def build() -> Engine:
            torch.set_num_threads(threads)  # a new thread starts from OMP_NUM_THREADS, not the caller's
            return Engine.from_config(config, **engine_kwargs)

        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="asyncrl-load") as pool:
            engine = pool.submit(build).result()
        return cls(engine, torch_threads=threads)

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="asyncrl-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def stats(self) -> dict[str, float]:
        """The engine's counters plus this driver's (read from the event loop; a snapshot)."""
        return self.engine.stats() | {"step_errors": self.num_step_errors}

    # -- called from the event loop ---------------------------------------------------------------
    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread between steps; return its result or raise its error."""
        fut = asyncio.get_running_loop().create_future()
        self._commands.put((fn, fut))
        self._wake.set()
        return await fut

    def submit(self, fn: Callable[[], Any]) -> None:
        """Fire-and-forget variant of `call` (safe from `finally` blocks of cancelled tasks)."""
        self._commands.put((fn, None))
        self._wake.set()

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], options: SamplingOptions, **kwargs: Any
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs until it finishes. Leaving early aborts it.

        Raises RequestFailedError when the engine failed this request (the others go on).
        """
        stream: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[request_id] = stream
        finished = False
        try:
            await self.call(lambda: self.engine.add_request(request_id, prompt_token_ids, options, **kwargs))
            while not finished:
                out = await stream.get()
                finished = out.finished
                if out.error is not None:
                    raise RequestFailedError(request_id, out.error)
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.submit(lambda: self.engine.abort(request_id))

    async def pause(self, mode: str) -> int:
        """Stop stepping. Mode 'abort' also finishes every request with 'abort'. Returns how many."""

        def run() -> int:
            self.paused = True
            if mode != "abort":
                return 0
            outs = self.engine.abort_all()
            self._deliver(outs)
            return len(outs)

        return await self.call(run)

    async def resume(self) -> None:
        def run() -> None:
            self.paused = False

        await self.call(run)

    async def update_weights(self, path: str, version: int, mode: str) -> dict[str, float]:
        """Read the checkpoint off the engine thread, then swap it in between two steps."""
        t0 = time.perf_counter()
        state = await asyncio.to_thread(on_one_torch_thread(self.engine.read_weights), path)
        load_seconds = time.perf_counter() - t0
        paused_seconds = await self.swap_weights(state, version, mode, path)
        return {"version": version, "load_seconds": load_seconds, "paused_seconds": paused_seconds}

    async def swap_weights(
        self, state: dict[str, torch.Tensor], version: int, mode: str, path: str | None
    ) -> float:
        """Swap in `state` (checked, in the engine's names and dtype) between two steps; the pause, in s."""

        def swap() -> float:
            t1 = time.perf_counter()
            if mode == "abort":
                self._deliver(self.engine.abort_all())
            self.engine.load_weights(state, version)
            if self.engine.device.type == "cuda":
                torch.cuda.synchronize(self.engine.device)
            self.weights_path = path
            return time.perf_counter() - t1

        return await self.call(swap)

    # -- engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        torch.set_num_threads(self.torch_threads)
        while not self._stop.is_set():
            self._run_commands()
            if self.paused or not self.engine.has_unfinished():
                self._wake.wait(timeout=0.1)
                self._wake.clear()
                continue
            try:
                outs = self.engine.step()
            except Exception as e:  # the engine thread's top level: fail the batch, keep serving
                # Per-request failures (the sampler) never get here; an error in the shared forward
                # cannot be pinned on one request, so every request of the batch fails with it.
                self.num_step_errors += 1
                log.exception("engine step failed; failing requests %s", sorted(self.engine.requests))
                outs = self.engine.fail_all(f"engine step failed: {type(e).__name__}: {e}")
            self._deliver(outs)

    def _run_commands(self) -> None:
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                result, error = fn(), None
            except Exception as e:  # handed back to the awaiting coroutine, which maps it to HTTP
                result, error = None, e
            if fut is not None:
                self._loop.call_soon_threadsafe(_settle, fut, result, error)
            elif error is not None:
                log.error("engine command failed: %s", error)

    def _deliver(self, outs: list[RequestOutput]) -> None:
        if outs:
            self._loop.call_soon_threadsafe(self._dispatch, outs)

    def _dispatch(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)


def _settle(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.cancelled():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
