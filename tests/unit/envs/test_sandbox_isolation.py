"""The OS boundary holds against escapes that the in-process guard lets through.

Each hostile script first gets past the audit-hook guard with plain standard-library calls (paths
relative to a directory descriptor, pidfd signals, `_posixsubprocess.fork_exec`), so what is tested
is bwrap's containment. The "bounded return" checks are hang detectors with seconds of slack, not
performance assertions.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from asyncrl.envs.sandbox import Isolation, Sandbox, SandboxIsolationError, SandboxLimits, probe_isolation
from asyncrl.envs.sandbox_bwrap import bwrap_argv

ISOLATION = probe_isolation()
needs_bwrap = pytest.mark.skipif(
    ISOLATION.mode != "bwrap", reason=f"needs a working bubblewrap: {ISOLATION.detail}"
)
LIMITS = SandboxLimits(cpu_s=2, wall_s=3.0)
SLACK_S = 5.0  # the call must end by wall_s + this; without the deadline these cases hang forever

# Gets descriptors the guard never checks: `lib` (the stdlib dir, readable) and `root` ("/", reached
# from `lib` by a relative path that the guard resolves against a deep cwd, i.e. inside the sandbox).
# A path relative to `root` then names any host file, and the guard believes it is inside.
ESCAPE_PRELUDE = """
import os, signal, sys
TOP = os.getcwd()
os.makedirs("d/" * 40, exist_ok=True)
os.chdir("d/" * 40)
lib = os.open(os.path.dirname(os.__file__), os.O_RDONLY)
root = os.open("../" * 30 + ".", os.O_RDONLY, dir_fd=lib)
def attempt(label, fn):
    try:
        print(label, "ESCAPED", fn())
    except OSError as e:
        print(label, "contained", type(e).__name__)
"""


def _run(sandbox: Sandbox, code: str, *args: str):
    sandbox.write_file("attempt.py", code)
    t0 = time.monotonic()
    result = asyncio.run(sandbox.run_python("attempt.py", list(args)))
    assert time.monotonic() - t0 < sandbox.limits.wall_s + SLACK_S
    return result


@pytest.fixture
def box():
    sandbox = Sandbox(limits=LIMITS)  # no weak mode: these tests are about the boundary
    yield sandbox
    sandbox.close()


def _outcomes(stdout: str) -> dict[str, str]:
    return {line.split()[0]: line.split()[1] for line in stdout.splitlines() if line.split()[1:]}


@needs_bwrap
def test_dir_fd_relative_read_write_rename_unlink_are_contained(box, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host-secret-41")
    rel = str(secret)[1:]  # relative to "/"
    escaped = box.dir.parent / f"escaped-{box.dir.name}"
    code = ESCAPE_PRELUDE + (
        f"attempt('read', lambda: os.read(os.open({rel!r}, os.O_RDONLY, dir_fd=root), 100))\n"
        f"attempt('write', lambda: os.open({str(escaped)[1:]!r}, os.O_WRONLY | os.O_CREAT, dir_fd=root))\n"
        "attempt('write_lib', lambda: os.open('escaped-by-sandbox', os.O_WRONLY | os.O_CREAT, dir_fd=lib))\n"
        f"attempt('rename', lambda: os.rename({rel!r}, {rel + '.moved'!r}, src_dir_fd=root, "
        "dst_dir_fd=root))\n"
        f"attempt('unlink', lambda: os.unlink({rel!r}, dir_fd=root))\n"
    )
    result = _run(box, code)
    assert result.returncode == 0, result.stderr
    assert _outcomes(result.stdout) == dict.fromkeys(
        ["read", "write", "write_lib", "rename", "unlink"], "contained"
    )
    assert "host-secret-41" not in result.stdout
    assert secret.read_text() == "host-secret-41" and not escaped.exists()
    assert not Path(os.path.dirname(os.__file__), "escaped-by-sandbox").exists()


@needs_bwrap
def test_host_proc_and_pidfd_signals_are_out_of_reach(box):
    victim = subprocess.Popen(["sleep", "30"])
    try:
        code = ESCAPE_PRELUDE + (
            "pids = sorted(int(p) for p in os.listdir(os.open('proc', os.O_RDONLY, dir_fd=root)) if "
            "p.isdigit())\n"
            "print('pids', *pids)\n"
            "attempt('environ', lambda: os.open(f'proc/{sys.argv[1]}/environ', os.O_RDONLY, dir_fd=root))\n"
            "for pid in sys.argv[1:]:\n"
            "    attempt('pidfd', lambda: signal.pidfd_send_signal(os.pidfd_open(int(pid)), "
            "signal.SIGKILL))\n"
        )
        result = _run(box, code, str(os.getpid()), str(victim.pid))
        assert result.returncode == 0, result.stderr
        pids = [int(p) for p in result.stdout.splitlines()[0].split()[1:]]
        assert 0 < len(pids) <= 4 and os.getpid() not in pids and victim.pid not in pids  # its own namespace
        lines = result.stdout.splitlines()[1:]
        assert lines == ["environ contained FileNotFoundError"] + ["pidfd contained ProcessLookupError"] * 2
        assert victim.poll() is None  # the host process was not signalled
    finally:
        victim.kill()
        victim.wait()


# A child the guard does not see (`_posixsubprocess.fork_exec` raises no audit event) that double-forks
# and calls setsid, holding stdout open; the marker lets the test find survivors in the host's /proc.
FORK_ESCAPE = """
import _posixsubprocess, os, sys
marker = sys.argv[1]
shell = f"(setsid sleep {marker} &) ; (sleep {marker} &) ; echo forked"
r, w = os.pipe()
_posixsubprocess.fork_exec([b"/bin/sh", b"-c", shell.encode()], [b"/bin/sh"], True, (), None, None,
    -1, -1, -1, -1, -1, -1, r, w, True, False, -1, None, None, None, -1, None, False)
"""


def _survivors(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _wait_gone(marker: str) -> list[int]:
    for _ in range(20):  # the kernel tears the namespace down as the call ends; allow it a moment
        if not (left := _survivors(marker)):
            return left
        time.sleep(0.1)
    return _survivors(marker)


@needs_bwrap
@pytest.mark.parametrize("then", ["exit", "sleep"])
def test_double_forked_setsid_children_die_with_the_call(box, then):
    marker = f"61.{os.getpid()}{len(then)}"
    tail = "import time\ntime.sleep(60)\n" if then == "sleep" else ""
    result = _run(box, FORK_ESCAPE + tail, marker)
    assert result.timed_out == (then == "sleep")
    assert "outlived the call" not in result.stderr
    assert _wait_gone(marker) == []


@needs_bwrap
def test_symlink_made_inside_pointing_out_is_contained(box, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host-secret-42")
    # The guard checks the target against the deep cwd (inside); the link itself sits at the top.
    code = ESCAPE_PRELUDE + (
        f"os.symlink('../' * 30 + {str(secret)[1:]!r}, os.path.join(TOP, 'link'))\n"
        "top = os.open(TOP, os.O_RDONLY)\n"
        "attempt('follow', lambda: os.read(os.open('link', os.O_RDONLY, dir_fd=top), 100))\n"
    )
    result = _run(box, code)
    assert result.stdout.splitlines() == ["follow contained FileNotFoundError"], result.stderr
    assert os.path.islink(box.dir / "link")  # it was made, and resolves to the secret on the host...
    with pytest.raises(ValueError, match="leaves the sandbox"):  # ...where the file tools refuse it
        box.read_file("link")


@needs_bwrap
def test_network_namespace_has_only_loopback(box):
    argv = bwrap_argv(ISOLATION.bwrap, box.dir, ["cat", "/proc/net/dev"])
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=30).stdout
    assert [line.split(":")[0].strip() for line in out.splitlines()[2:]] == ["lo"]


def test_weak_mode_is_refused_unless_allowed():
    weak = Isolation(mode="weak", detail="no bwrap on PATH (simulated)")
    with pytest.raises(SandboxIsolationError, match=r"no bwrap on PATH \(simulated\).*allow_weak_isolation"):
        Sandbox(isolation=weak)
    box = Sandbox(isolation=weak, allow_weak_isolation=True, limits=LIMITS)
    try:
        result = _run(box, "print(1)")
        assert result.ok and result.stdout == "1\n"
        assert (
            result.isolation["boundary"].startswith("WEAK") and "(simulated)" in result.isolation["boundary"]
        )
        assert "bypassable" in result.isolation["files"]
    finally:
        box.close()


def test_weak_mode_call_is_bounded_even_when_an_escaped_child_holds_stdout():
    """Without bwrap a setsid child escapes the process-group kill; the call must still return."""
    box = Sandbox(
        isolation=Isolation(mode="weak", detail="simulated"), allow_weak_isolation=True, limits=LIMITS
    )
    marker = f"62.{os.getpid()}"
    try:
        result = _run(box, FORK_ESCAPE + "import time\ntime.sleep(60)\n", marker)
        assert result.timed_out and "outlived the call holding its output; abandoned" in result.stderr
    finally:
        for pid in _survivors(marker):  # weak mode cannot kill them; the test cleans up after itself
            os.kill(pid, signal.SIGKILL)
        box.close()


def test_probe_reports_its_reason():
    if ISOLATION.mode == "bwrap":
        assert (
            ISOLATION.bwrap and ISOLATION.detail.startswith("bubblewrap ") and "uid 65534" in ISOLATION.detail
        )
    else:
        assert ISOLATION.bwrap is None and "bwrap" in ISOLATION.detail  # names the missing piece and the fix


@needs_bwrap
def test_read_only_dirs_under_a_tmpfs_path_stay_visible(tmp_path):
    """A venv under /tmp (CI makes them there) is bound over the sandbox's own /tmp, not hidden by it."""
    venv = Path("/tmp") / f"asyncrl-test-venv-{os.getpid()}"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    (venv / "bin" / "marker").write_text("here\n")
    try:
        argv = bwrap_argv(
            ISOLATION.bwrap,
            tmp_path,
            ["cat", str(venv / "bin" / "marker")],
            read_only_dirs=(str(venv),),
            tmpfs=(("/tmp", 1 << 20),),
        )
        result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        assert (result.returncode, result.stdout) == (0, "here\n"), result.stderr
    finally:
        (venv / "bin" / "marker").unlink()
        (venv / "bin").rmdir()
        venv.rmdir()
