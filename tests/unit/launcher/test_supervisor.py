"""Process supervision: success, failure naming, restarts, and no orphans (plain Python children)."""

from __future__ import annotations

import os
import sys
import time

from asyncrl.launcher.supervisor import ChildSpec, Supervisor


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still "exists"; look at its state
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_done_child_ends_the_run_and_stops_the_rest(tmp_path, capsys):
    sup = Supervisor(
        [
            ChildSpec(name="server", argv=_py("import time; time.sleep(60)"), log=tmp_path / "s.log"),
            ChildSpec(
                name="trainer",
                argv=_py("print('step 1 | loss 0.5'); import time; time.sleep(0.5)"),
                log=tmp_path / "t.log",
                echo_prefixes=("step ",),
                done_ok=True,
            ),
        ],
        poll_s=0.05,
    )
    assert sup.run() == 0
    assert all(c.proc.poll() is not None for c in sup.children)
    assert "[trainer] step 1 | loss 0.5" in capsys.readouterr().out
    assert "step 1" in (tmp_path / "t.log").read_text()


def test_the_run_waits_for_every_done_child(tmp_path):
    sup = Supervisor(
        [
            ChildSpec(name="server", argv=_py("import time; time.sleep(60)"), log=tmp_path / "s.log"),
            ChildSpec(name="trainer", argv=_py("pass"), log=tmp_path / "t.log", done_ok=True),
            ChildSpec(
                name="orchestrator",
                argv=_py("import time; time.sleep(1); print('evaluated')"),
                log=tmp_path / "o.log",
                done_ok=True,
            ),
        ],
        poll_s=0.05,
    )
    assert sup.run() == 0
    assert "evaluated" in (tmp_path / "o.log").read_text()  # the trainer's exit did not cut it short


def test_failing_child_is_named_and_grandchildren_are_killed(tmp_path, capsys):
    pidfile = tmp_path / "grandchild.pid"
    spawn_and_die = (
        "import subprocess, sys, time;"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
        f"open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(0.5); print('boom'); sys.exit(3)"
    )
    sup = Supervisor(
        [
            ChildSpec(name="orchestrator", argv=_py("import time; time.sleep(60)"), log=tmp_path / "o.log"),
            ChildSpec(name="trainer", argv=_py(spawn_and_die), log=tmp_path / "t.log", done_ok=True),
        ],
        poll_s=0.05,
    )
    t0 = time.monotonic()
    assert sup.run() == 1
    assert time.monotonic() - t0 < 20
    assert sup.failed == "trainer"
    err = capsys.readouterr().err
    assert "process 'trainer' exited with code 3" in err and "boom" in err
    assert not _alive(sup.children[0].proc.pid)
    grandchild = int(pidfile.read_text())
    deadline = time.monotonic() + 5  # SIGKILL was sent to its process group; give the kernel a moment
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild), "the failed child's own child must not be orphaned"


def test_restartable_child_is_restarted(tmp_path, capsys):
    marker = tmp_path / "crashed-once"
    flaky = (
        f"import os, sys, time; p = {str(marker)!r}\n"
        "if not os.path.exists(p): open(p, 'w').close(); sys.exit(1)\n"
        "time.sleep(60)"
    )
    sup = Supervisor(
        [
            ChildSpec(name="inference-0", argv=_py(flaky), log=tmp_path / "i.log", max_restarts=2),
            ChildSpec(
                name="trainer", argv=_py("import time; time.sleep(1.5)"), log=tmp_path / "t.log", done_ok=True
            ),
        ],
        poll_s=0.05,
    )
    assert sup.run() == 0
    assert sup.children[0].num_restarts == 1
    assert "process 'inference-0' exited with code 1; restarting (1/2)" in capsys.readouterr().err
