"""Every escape attempt fails cleanly, with a clear error and no hang.

These exercise the in-process guard and the limits, so they run under bwrap where it works and in
weak mode elsewhere; the OS-boundary escapes are in test_sandbox_isolation.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time

import pytest

from asyncrl.envs.sandbox import (
    Sandbox,
    SandboxLimits,
    SandboxPathError,
    network_isolation_prefix,
    probe_isolation,
)

LIMITS = SandboxLimits(cpu_s=1, wall_s=10.0, max_output_bytes=4096, max_file_bytes=1 << 20)


@pytest.fixture
def sandbox():
    box = Sandbox(limits=LIMITS, allow_weak_isolation=True)  # bwrap when it works here
    yield box
    box.close()
    assert not box.dir.exists()


def _run(sandbox: Sandbox, code: str):
    sandbox.write_file("attempt.py", code)
    t0 = time.monotonic()
    result = asyncio.run(sandbox.run_python("attempt.py"))
    assert time.monotonic() - t0 < sandbox.limits.wall_s + 2.0  # no hang
    return result


def test_normal_run_and_isolation_report(sandbox):
    sandbox.write_file("lib/helper.py", "def f():\n    return 41\n")
    result = _run(
        sandbox,
        "import json, collections\nfrom lib.helper import f\nprint(json.dumps(f() + 1))\nopen('out.txt', "
        "'w').write('ok')",
    )
    assert result.ok and result.stdout == "42\n" and result.error_summary() is None
    assert sandbox.read_file("out.txt") == "ok"
    assert set(result.isolation) == {"boundary", "network", "files", "processes", "limits"}
    weak = probe_isolation().mode == "weak"
    assert result.isolation["boundary"].startswith("WEAK") == weak


def test_write_outside_fails(sandbox, tmp_path):
    target = tmp_path / "outside.txt"
    result = _run(sandbox, "open('../outside.txt', 'w').write('x')\n")
    assert (
        "PermissionError: sandbox: writing '../outside.txt' is outside the sandbox" in result.error_summary()
    )
    assert not (sandbox.dir.parent / "outside.txt").exists()
    result = _run(sandbox, f"import os\nos.symlink('{target}', 'link')\nopen('link', 'w').write('x')\n")
    assert result.returncode == 1 and "outside the sandbox" in result.stderr
    assert not target.exists()


def test_read_outside_fails(sandbox):
    result = _run(sandbox, "print(open('/etc/hostname').read())")
    assert "reading '/etc/hostname' is outside the sandbox" in result.error_summary()
    result = _run(sandbox, "import os\nprint(os.listdir('/'))")
    assert "os.listdir" in result.error_summary() and result.stdout == ""


def test_fork_bomb_lite_fails(sandbox):
    result = _run(sandbox, "import os\nfor _ in range(100):\n    os.fork()\n")
    assert result.error_summary() == "exit code 1: PermissionError: sandbox: os.fork is not allowed"
    result = _run(sandbox, "import subprocess\nsubprocess.run(['sh', '-c', ':(){ :|:& };:'])")
    assert "subprocess.Popen is not allowed" in result.error_summary()


def test_infinite_loop_is_killed_by_cpu_limit(sandbox):
    # LIMITS has a generous wall clock, so that the CPU limit (not the timeout) fires on a loaded machine.
    result = _run(sandbox, "while True:\n    pass\n")
    assert (
        result.returncode == -signal.SIGXCPU and result.error_summary() == "killed: CPU time limit exceeded"
    )


def test_sleeping_process_is_killed_by_wall_clock(sandbox):
    sandbox.limits = SandboxLimits(cpu_s=1, wall_s=2.0)
    result = _run(sandbox, "import time\nprint('start', flush=True)\ntime.sleep(60)\n")
    assert result.timed_out and result.stdout == "start\n"
    assert result.error_summary().startswith("killed: wall-clock timeout")


def test_huge_output_is_capped(sandbox):
    result = _run(sandbox, "import sys\nwhile True:\n    sys.stdout.write('x' * 10000)\n")
    assert result.output_truncated and result.error_summary() == "killed: output limit exceeded"
    assert len(result.stdout) + len(result.stderr) <= LIMITS.max_output_bytes


def test_huge_file_and_memory_fail(sandbox):
    result = _run(sandbox, "open('big', 'wb').write(b'x' * (8 << 20))")
    assert "File too large" in result.error_summary()
    result = _run(sandbox, "x = bytearray(8 << 30)")
    assert result.error_summary() == "exit code 1: MemoryError"


def test_socket_fails(sandbox):
    result = _run(sandbox, "import socket\ns = socket.create_connection(('127.0.0.1', 22), timeout=1)")
    assert "socket.__new__ is not allowed" in result.error_summary()
    result = _run(sandbox, "import ctypes")
    assert "ctypes.dlopen is not allowed" in result.error_summary()


def test_network_namespace_when_available(sandbox):
    prefix, description = network_isolation_prefix()
    if not prefix:
        pytest.skip(f"no network namespace here: {description}")
    bwrap = sandbox.isolation_mode.mode == "bwrap"
    expected = "netns (bwrap; loopback only)" if bwrap else description
    assert _run(sandbox, "print(1)").isolation["network"] == expected
    # The namespace alone, guard aside: only a loopback device, so nothing outside is reachable.
    out = subprocess.run([*prefix, "cat", "/proc/net/dev"], capture_output=True, text=True, check=True).stdout
    assert [line.split(":")[0].strip() for line in out.splitlines()[2:]] == ["lo"]


def test_host_side_paths_are_confined(sandbox):
    for bad in ("../x", "/etc/passwd", "a/../../x", ""):
        with pytest.raises(SandboxPathError):
            sandbox.write_file(bad, "x")
    os.symlink("/etc", sandbox.dir / "etc_link")
    with pytest.raises(SandboxPathError, match="leaves the sandbox"):
        sandbox.read_file("etc_link/hostname")
