"""The OS-level boundary of the sandbox: a bubblewrap (`bwrap`) command line, and a one-time probe.

    isolation = probe_isolation()          # Isolation(mode="bwrap", detail="bubblewrap 0.8.0, ...")
    argv = bwrap_argv(isolation.bwrap, workdir, [sys.executable, "-I", "-S", ...], network=False)

What one call gets (see docs/envs.md, "Sandbox"):
- a mount namespace whose root is an empty read-only tmpfs, with read-only binds of /usr (and the
  /bin, /lib, /lib64, /sbin entries the host has), the dynamic linker cache and the interpreter's
  prefix; the episode's working directory (and any size-limited tmpfs the caller asks for, private
  to the call) is the only writable path; a fresh /proc of its own PID namespace and a minimal
  /dev; nothing else of the host exists inside;
- PID, IPC, UTS, cgroup and network namespaces (only a loopback device), so host processes cannot
  be seen or signalled and every descendant dies with the call (`--die-with-parent`: when bwrap
  dies, its PID 1 dies, and the kernel kills the whole namespace);
- a user namespace with uid/gid 65534 ("nobody") and no capabilities, in a new session (no TIOCSTI).

The probe runs the real command once per process, so that the answer reflects what this kernel and
container actually permit (user namespaces can be disabled by sysctl, seccomp or AppArmor).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = ["SANDBOX_UID", "Isolation", "bwrap_argv", "probe_isolation"]

SANDBOX_UID = 65534  # "nobody"; also the gid
_INSTALL_HINT = "install bubblewrap (Debian/Ubuntu: apt-get install -y bubblewrap)"


@dataclass(frozen=True, kw_only=True)
class Isolation:
    """What the sandbox can use here. mode "weak" = no OS boundary, only the in-process guard."""

    mode: Literal["bwrap", "weak"]
    detail: str  # the bwrap version, or why bwrap cannot be used (with the fix)
    bwrap: str | None = None  # path of the bwrap binary when mode == "bwrap"


def _system_binds() -> list[str]:
    """Read-only views of the host's system directories, keeping /bin -> usr/bin style symlinks."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(name):
            args += ["--symlink", os.readlink(name), name]
        elif os.path.isdir(name):
            args += ["--ro-bind", name, name]
    return [*args, "--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]


@functools.cache
def _interpreter_roots() -> tuple[str, ...]:
    """Directories the interpreter needs (its prefix: executable, stdlib, extension modules) outside /usr."""
    candidates = {sys.base_prefix, sys.prefix, os.path.dirname(os.path.realpath(sys.executable))}
    roots = sorted({os.path.realpath(p) for p in candidates})
    kept: list[str] = []
    for root in roots:  # sorted, so a parent comes before its children
        if root == "/usr" or root.startswith("/usr/"):
            continue
        if not any(root.startswith(k + os.sep) for k in kept):
            kept.append(root)
    return tuple(kept)


def bwrap_argv(
    bwrap: str,
    workdir: Path,
    argv: list[str],
    *,
    network: bool = False,
    read_only_files: tuple[str | tuple[str, str], ...] = (),
    workdir_dest: str | None = None,
    read_only_dirs: tuple[str, ...] = (),
    tmpfs: tuple[tuple[str, int], ...] = (),
) -> list[str]:
    """The command that runs `argv` in `workdir` inside the boundary of the module docstring.

    `read_only_files` (e.g. the guard script) and `read_only_dirs` (e.g. a virtual environment) are
    bound read-only at their own paths; `read_only_files` may also be (host path, sandbox path)
    pairs. `workdir_dest`: where the working directory appears inside (default: its own path).
    `tmpfs`: (path, size in bytes) of fresh size-limited tmpfs mounts, private to the call.
    """
    args = [
        bwrap,
        "--unshare-all",
        "--unshare-user",
        "--uid",
        str(SANDBOX_UID),
        "--gid",
        str(SANDBOX_UID),
        "--cap-drop",
        "ALL",
        "--die-with-parent",
        "--new-session",
        "--hostname",
        "sandbox",
    ]
    if network:
        args.append("--share-net")
    args += _system_binds()
    for path, size in tmpfs:  # first: a bind under a tmpfs path (a venv in /tmp) is mounted over it
        args += ["--size", str(size), "--tmpfs", path]
    for root in _interpreter_roots():
        args += ["--ro-bind", root, root]
    for path in read_only_dirs:
        args += ["--ro-bind", path, path]
    for item in read_only_files:
        source, dest = (item, item) if isinstance(item, str) else item
        args += ["--ro-bind", source, dest]
    args += ["--proc", "/proc", "--dev", "/dev"]
    dest = workdir_dest or str(workdir)
    args += ["--bind", str(workdir), dest, "--remount-ro", "/", "--chdir", dest]
    return [*args, "--", *argv]


@functools.cache
def probe_isolation() -> Isolation:
    """Run a trivial interpreter under `bwrap_argv` once; "weak" with the reason if anything fails."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return Isolation(mode="weak", detail=f"no bwrap on PATH; {_INSTALL_HINT}")
    with tempfile.TemporaryDirectory(prefix="asyncrl-sandbox-probe-") as tmp:
        code = "import os; open('probe', 'w').write('ok'); print(os.getuid(), os.getgid())"
        argv = bwrap_argv(bwrap, Path(tmp), [sys.executable, "-I", "-S", "-c", code])
        try:
            probe = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
        except subprocess.TimeoutExpired:
            return Isolation(mode="weak", detail=f"{bwrap} did not finish a trivial run in 30 s")
        wrote = Path(tmp, "probe").is_file()
    expected = f"{SANDBOX_UID} {SANDBOX_UID}"
    if probe.returncode != 0 or probe.stdout.strip() != expected or not wrote:
        why = probe.stderr.strip()[-300:] or f"exit code {probe.returncode}, stdout {probe.stdout.strip()!r}"
        hint = (
            "user namespaces are probably disabled (check kernel.unprivileged_userns_clone, "
            "user.max_user_namespaces, or the container's seccomp/AppArmor profile)"
        )
        return Isolation(mode="weak", detail=f"{bwrap} cannot build the sandbox here: {why}; {hint}")
    version = subprocess.run([bwrap, "--version"], capture_output=True, text=True, check=False).stdout.strip()
    return Isolation(mode="bwrap", detail=f"{version or bwrap}, uid {SANDBOX_UID}", bwrap=bwrap)
