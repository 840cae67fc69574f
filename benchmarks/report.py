"""Shared by the benchmark scripts: write one section of BENCHMARKS.md in place, name the machine,
time interleaved runs.

Run a script as `python benchmarks/<name>.py`: Python puts this folder on sys.path, so
`from report import write_section` resolves here.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "BENCHMARKS.md"

__all__ = ["BENCHMARKS", "machine", "time_interleaved", "write_section"]


def _cpuinfo(key: str) -> str:
    """The first /proc/cpuinfo value of `key` ("" where there is none)."""
    if not os.path.exists("/proc/cpuinfo"):
        return ""
    with open("/proc/cpuinfo") as f:
        return next((ln.split(":", 1)[1].strip() for ln in f if ln.split(":")[0].strip() == key), "")


def machine() -> str:
    """CPU model, cores, memory and the matmul extensions torch's CPU kernels can use: bf16 speed
    depends on them, so every section that quotes timings names them."""
    flags = set(_cpuinfo("flags").split())
    has = [f for f in ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    lacks = [f for f in ("avx512_bf16", "amx_bf16") if f not in flags]
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{_cpuinfo('model name') or platform.machine()}, {os.cpu_count()} CPUs (shared with other jobs), "
        f"{mem:.0f} GiB; flags {' '.join(has) or 'none of avx512f/avx512_bf16/amx'}"
        + (f", no {' / '.join(lacks)}" if lacks else "")
    )


def write_section(title: str, body: str, path: Path = BENCHMARKS) -> None:
    """Replace the section headed `title` (a '## ' line, up to the next '## '), or append it.

    `body` is the whole section, starting with the `title` line itself.
    """
    if not body.startswith(title + "\n"):
        raise ValueError(f"section body must start with its title line {title!r}")
    text = (
        path.read_text()
        if path.exists()
        else "# Benchmarks\n\nNumbers from this repository's benchmark scripts.\n"
    )
    start = text.find(title + "\n")
    if start < 0:
        text = text.rstrip() + "\n\n" + body
    else:
        end = text.find("\n## ", start + len(title))
        text = text[:start] + body.rstrip("\n") + "\n" + ("\n" + text[end + 1 :] if end >= 0 else "")
    path.write_text(text)


def time_interleaved(runs: list[tuple[Callable[[], None], int]]) -> list[float]:
    """Median CPU seconds per call of each (function, steps), the functions alternating round by round
    so that machine noise hits them alike (one that has had its steps drops out). Each timed call
    follows an untimed call of the same function: a training loop runs one step after another, so
    the allocator holds what the step needs; timed straight after another model's step, a step pays
    for its memory again (page faults, counted as system CPU time): up to ~15% of bench_model's
    bf16 step, unevenly between the implementations. CPU time, not wall time: on one
    thread it is what a step costs, whatever else a shared machine runs meanwhile."""
    times: list[list[float]] = [[] for _ in runs]
    for step in range(max(steps for _, steps in runs)):
        for (fn, steps), ts in zip(runs, times, strict=True):
            if step < steps:
                fn()  # settles the allocator (and, the first time, warms up)
                start = time.process_time()
                fn()
                ts.append(time.process_time() - start)
    return [statistics.median(ts) for ts in times]
