"""The sandbox pool: pristine reuse, kills at deadline / cancel / release, the reaper, and the limits."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from asyncrl.envs.sandbox_bwrap import probe_isolation
from asyncrl.envs.sandbox_pool import PoolLimits, SandboxLimitError, SandboxPool
from asyncrl.envs.sandbox_reaper import leftovers, mounts_under
from helpers import child_env, left_after_kill, processes_naming

pytestmark = pytest.mark.skipif(probe_isolation().mode != "bwrap", reason="the pool needs bubblewrap")

ENV = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"}
LIMITS = PoolLimits(memory_bytes=256 << 20, max_processes=32, disk_bytes=8 << 20, command_wall_s=20.0)


class TemplateWorkspace:
    """A directory copied from a dict of files; reset rewrites it from scratch."""

    def __init__(self, key: str, files: dict[str, str]) -> None:
        self.key, self.files = key, files
        self.resets = 0

    def create(self, work: Path, private: Path) -> None:
        for name, text in self.files.items():
            (work / name).parent.mkdir(parents=True, exist_ok=True)
            (work / name).write_text(text)

    def reset(self, work: Path, private: Path) -> None:
        self.resets += 1
        subprocess.run(["find", str(work), "-mindepth", "1", "-delete"], check=True)
        self.create(work, private)


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def pool(tmp_path):
    pool = SandboxPool(root=tmp_path / "root", max_sandboxes=2, limits=LIMITS)
    yield pool
    pool.close()
    assert not pool.run_dir.path.exists() and not mounts_under(tmp_path)


async def _wait_idle(pool: SandboxPool, num: int = 1) -> None:
    for _ in range(500):
        if pool.counts()["idle"] >= num:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(pool.counts())


def test_reuse_after_reset_is_pristine(pool):
    ws = TemplateWorkspace("k", {"a.txt": "alpha\n", "pkg/b.py": "B = 1\n"})

    async def scenario():
        box = await pool.acquire(ws)
        assert not box.warm and _snapshot(box.work) == ws.files
        cmd = "echo changed > a.txt && rm pkg/b.py && mkdir -p new && echo x > new/c && chmod 000 new"
        result = await box.run(["bash", "-c", cmd], env=ENV)
        assert result.returncode == 0, result
        work = box.work
        pool.release(box)
        await _wait_idle(pool)
        again = await pool.acquire(ws)
        assert again.warm and again.work == work and ws.resets == 1
        assert _snapshot(again.work) == ws.files  # the agent's edits, deletions and new files are gone
        pool.release(again)

    asyncio.run(scenario())
    assert pool.counts()["created"] == 1 and pool.counts()["warm"] == 1


def test_commands_see_only_the_sandbox(pool):
    async def scenario():
        box = await pool.acquire(TemplateWorkspace("k", {"f": "x"}))
        here = Path(__file__).resolve()
        cmd = f"pwd; id -u; ls -A /tmp; cat {here} || true; echo hi > /etc/x || true; python -c 'print(6*7)'"
        result = await box.run(["bash", "-c", cmd], env=ENV)
        pool.release(box)
        return result

    result = asyncio.run(scenario())
    lines = result.stdout.splitlines()  # this file is not there
    assert lines[:2] == ["/repo", "65534"] and lines[-1] == "42"
    # /tmp is empty but for an interpreter that lives there (a venv under /tmp), bound for python
    assert set(lines[2:-1]) <= _tmp_roots(), lines
    assert "No such file or directory" in result.stderr
    assert "Read-only file system" in result.stderr or "/etc/x: No such file" in result.stderr


def test_deadline_and_cancel_and_release_kill_the_whole_tree(pool):
    ws = TemplateWorkspace("k", {"f": "x"})
    spawn = "for i in 1 2 3; do (setsid sleep 300 &); done; sleep 300"

    async def scenario():
        box = await pool.acquire(ws)
        t0 = time.monotonic()
        result = await box.run(["bash", "-c", spawn], env=ENV, timeout_s=1.0)
        assert result.timed_out and time.monotonic() - t0 < 5.0
        assert not left_after_kill(pool.run_dir.path)  # deadline: nothing left
        task = asyncio.create_task(box.run(["bash", "-c", spawn], env=ENV, timeout_s=60))
        await asyncio.sleep(0.5)
        assert processes_naming(pool.run_dir.path)  # it runs
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not left_after_kill(pool.run_dir.path)  # cancellation: nothing left
        task = asyncio.create_task(box.run(["bash", "-c", spawn], env=ENV, timeout_s=60))
        await asyncio.sleep(0.5)
        pool.release(box)  # episode end while a command runs
        result = await task
        assert result.returncode is not None and result.returncode < 0
        assert not left_after_kill(pool.run_dir.path)

    asyncio.run(scenario())
    assert not list((pool.run_dir.path / "pids").iterdir())


def test_acquire_waits_at_the_bound_and_replaces_idle_sandboxes_of_other_keys(tmp_path):
    pool = SandboxPool(root=tmp_path / "root", max_sandboxes=1, limits=LIMITS)
    a, b = TemplateWorkspace("a", {"f": "a"}), TemplateWorkspace("b", {"f": "b"})

    async def scenario():
        box = await pool.acquire(a)
        waiting = asyncio.create_task(pool.acquire(b))
        await asyncio.sleep(0.2)
        assert not waiting.done()  # the one sandbox is busy
        pool.release(box)
        other = await asyncio.wait_for(waiting, 10)
        assert _snapshot(other.work) == {"f": "b"}
        pool.release(other)

    try:
        asyncio.run(scenario())
        assert pool.counts()["created"] == 2 and pool.counts()["destroyed"] == 1
    finally:
        pool.close()


def test_prewarm_creates_ahead_within_the_bound(pool):
    ws = TemplateWorkspace("k", {"f": "x"})

    async def scenario():
        assert pool.prewarm(ws, 5) == 2  # max_sandboxes = 2
        await _wait_idle(pool, 2)
        box = await pool.acquire(ws)
        assert box.warm and box.start_latency_s < 0.5
        pool.release(box)

    asyncio.run(scenario())


_ORCHESTRATOR = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from asyncrl.envs.sandbox_pool import SandboxPool, PoolLimits

    class W:
        key = "k"
        def create(self, work, private):
            (work / "f").write_text("x")
        def reset(self, work, private):
            pass

    async def churn(box, env):
        while True:  # commands starting all the time: some are in bwrap's set-up when the kill comes
            await box.run(["bash", "-c", "sleep 600"], env=env, timeout_s=0.05)

    async def main():
        pool = SandboxPool(root=sys.argv[1], max_sandboxes=5, limits=PoolLimits(command_wall_s=600))
        boxes = [await pool.acquire(W()) for _ in range(5)]
        env = {"PATH": "/usr/bin:/bin"}
        sleeper = ["bash", "-c", "sleep 600 & sleep 600"]
        runs = [asyncio.create_task(b.run(sleeper, env=env)) for b in boxes[:3]]
        runs += [asyncio.create_task(churn(b, env)) for b in boxes[3:]]
        await asyncio.sleep(0.5)
        print("ready", flush=True)
        await asyncio.gather(*runs)

    asyncio.run(main())
    """
)


def test_reaper_removes_what_a_killed_orchestrator_left(tmp_path):
    root = tmp_path / "root"
    proc = subprocess.Popen(
        [sys.executable, "-c", _ORCHESTRATOR, str(root)], stdout=subprocess.PIPE, env=child_env(), text=True
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        (run,) = root.iterdir()
        assert processes_naming(run)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not left_after_kill(run)  # the sandboxes die with it (a set-up under way finishes first)
    before = leftovers(root)
    assert before.runs == 1 and before.dirs == 1 and before.processes == 0
    pool = SandboxPool(root=root, limits=LIMITS)  # a restart: its reaper runs first
    try:
        assert pool.reaped.runs == 1 and pool.reaped.dirs == 1
        assert pool.reaped.mounts == before.mounts and pool.reaped.cgroups == before.cgroups
        assert leftovers(root).total == 0 and not run.exists() and not mounts_under(run)
        assert not processes_naming(run)
        if pool.tmpfs:
            assert before.mounts == 5
        if pool.cgroups:
            assert before.cgroups >= 1 and not any(p.exists() for p in _recorded_cgroups(run, pool))
    finally:
        pool.close()


def _recorded_cgroups(run: Path, pool: SandboxPool) -> list[Path]:
    return [d / run.name for d in pool.cgroups.dirs]


def test_a_live_run_is_never_reaped(tmp_path):
    first = SandboxPool(root=tmp_path / "root", limits=LIMITS)
    try:
        second = SandboxPool(root=tmp_path / "root", limits=LIMITS)
        assert second.reaped.runs == 0 and first.run_dir.path.exists()
        second.close()
    finally:
        first.close()


def _run_one(pool: SandboxPool, command: str, **kwargs):
    async def scenario():
        box = await pool.acquire(TemplateWorkspace("k", {"f": "x"}))
        try:
            return await box.run(["bash", "-c", command], env=ENV, **kwargs)
        finally:
            pool.release(box)

    return asyncio.run(scenario())


def test_process_limit_holds(pool):
    if not pool.cgroups:
        pytest.skip("no cgroups here: RLIMIT_NPROC does not bind a root caller")
    result = _run_one(pool, "for i in $(seq 64); do sleep 1 & done 2>&1; wait; echo done", timeout_s=15)
    assert "Resource temporarily unavailable" in result.stdout + result.stderr


def test_memory_limit_holds(pool):
    one = _run_one(pool, "python -c 'b = bytearray(400 << 20)'")  # more than the 256 MiB limit
    assert one.returncode != 0 and ("MemoryError" in one.stderr or one.returncode == -signal.SIGKILL)
    if pool.cgroups:  # four processes of 100 MiB each: within RLIMIT_AS, over the tree's limit
        code = "import time; b = bytearray(100 << 20); b[::4096] = b'x' * len(b[::4096]); time.sleep(1)"
        many = _run_one(pool, f'for i in 1 2 3 4; do python -c "{code}" & done; wait; echo end')
        assert "Killed" in many.stderr, many  # the cgroup's OOM killer


def test_disk_limit_holds_with_tmpfs(pool):
    if not pool.tmpfs:
        pytest.skip("mounting a tmpfs needs root here")
    result = _run_one(pool, "head -c 20000000 /dev/zero > big; ls -l big")
    assert "No space left on device" in result.stderr


def test_disk_limit_holds_in_check_mode(tmp_path):
    pool = SandboxPool(root=tmp_path / "root", limits=LIMITS, use_tmpfs=False)

    async def scenario():
        box = await pool.acquire(TemplateWorkspace("k", {"f": "x"}))
        await box.run(["bash", "-c", "head -c 9000000 /dev/zero > big"], env=ENV)
        with pytest.raises(SandboxLimitError, match="over its disk limit"):
            await box.run(["bash", "-c", "true"], env=ENV)
        pool.release(box)
        await _wait_idle(pool)
        again = await pool.acquire(box._slot.workspace)  # reset: back under the limit, usable again
        assert (await again.run(["bash", "-c", "ls"], env=ENV)).stdout == "f\n"
        pool.release(again)

    try:
        asyncio.run(scenario())
    finally:
        pool.close()


def test_cpu_file_size_and_wall_limits_hold(tmp_path):
    limits = PoolLimits(cpu_s=1, max_file_bytes=1 << 20, command_wall_s=20.0)
    pool = SandboxPool(root=tmp_path / "root", limits=limits)
    try:
        spin = _run_one(pool, "python -c 'while True: pass'")
        assert spin.returncode in (-signal.SIGXCPU, -signal.SIGKILL) and not spin.timed_out
        big = _run_one(pool, "head -c 2000000 /dev/zero > big; ls -l big")
        assert "File size limit exceeded" in big.stderr
        slow = _run_one(pool, "sleep 30", timeout_s=0.5)
        assert slow.timed_out and slow.wall_s < 5
    finally:
        pool.close()


def test_isolation_report_says_what_enforces_each_limit(pool):
    report = pool.isolation()
    assert report["runtime"].startswith("bwrap")
    assert ("cgroup" in report["memory"]) == bool(pool.cgroups)
    assert ("tmpfs of" in report["disk"]) == bool(pool.tmpfs)


def _tmp_roots() -> set[str]:
    """The entries of /tmp that hold this interpreter."""
    paths = (sys.prefix, sys.base_prefix)
    return {Path(p).relative_to("/tmp").parts[0] for p in paths if Path(p).is_relative_to("/tmp")}
