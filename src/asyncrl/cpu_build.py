"""Building the small C kernels of the engine (inference/cpu_decode.c, cpu_matmul.c) and the model
(model/cpu_norm.c, cpu_scores.c) with the system's C compiler.

Each shared library is built once per source, flags, compiler and CPU (`-march=native`) into
`$ASYNCRL_KERNEL_CACHE`, else `$XDG_CACHE_HOME/asyncrl/kernels` or `~/.cache/asyncrl/kernels`, with
`$CC` (default: the first of cc, gcc, clang on PATH). Built with `-fopenmp` and loaded after torch,
a library binds to the OpenMP runtime torch loaded (same soname), so it runs on torch's own thread
pool with torch's thread count for the calling thread; ctypes releases the GIL for each call.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

__all__ = ["BUILD_ERRORS", "FLAGS", "Unavailable", "build", "load_checked"]

log = logging.getLogger(__name__)

K = TypeVar("K")

# -ffast-math lets a loop of expf calls vectorise (glibc's vector expf) where the compiler vectorises
# that loop at all; the kernels see finite values only.
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC")
_BUILD_TIMEOUT_S = 120


class Unavailable(Exception):
    """No kernel on this machine for a reason that is not a fault (no compiler, no such ISA)."""


# What a failed build, load or self-check of a kernel raises (the caller falls back to torch's path).
BUILD_ERRORS = (OSError, subprocess.SubprocessError, RuntimeError, ValueError)


def compiler() -> str:
    cc = os.environ.get("CC")
    if cc:
        found = shutil.which(cc)
        if found is None:
            raise Unavailable(f"CC={cc!r} not found")
        return found
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return found
    raise Unavailable("no C compiler on PATH (cc, gcc, clang; or set CC)")


def _cpu_id() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    keep = [ln for ln in lines if ln.startswith(("model name", "flags", "Features", "CPU part"))]
    return "\n".join(dict.fromkeys(keep)) or platform.processor()


def _cache_dir() -> Path:
    if os.environ.get("ASYNCRL_KERNEL_CACHE"):
        return Path(os.environ["ASYNCRL_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "asyncrl" / "kernels"


def build(source_path: Path, what: str) -> Path:
    """The shared library of `source_path`, built now or found built; `what` names it in the log.
    Raises Unavailable (no compiler), RuntimeError (the compiler failed) or OSError."""
    cc = compiler()
    source = source_path.read_bytes()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(
        b"\0".join(
            [
                source,
                " ".join(FLAGS).encode(),
                cc.encode(),
                version.encode(),
                _cpu_id().encode(),
                platform.machine().encode(),
            ]
        )
    ).hexdigest()[:16]
    directory = _cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        directory = Path(tempfile.gettempdir()) / f"asyncrl-kernels-{os.getuid()}"
        directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{source_path.stem}-{key}.so"
    if path.exists():
        return path
    partial = directory / f".{path.name}.{os.getpid()}.tmp"
    log.info("building the %s with %s (once per compiler and CPU) into %s", what, cc, path)
    done = subprocess.run(
        [cc, *FLAGS, "-o", str(partial), str(source_path), "-lm"],
        capture_output=True,
        text=True,
        timeout=_BUILD_TIMEOUT_S,
    )
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"{Path(cc).name} exited {done.returncode}: {done.stderr.strip()[-500:]}")
    os.replace(partial, path)  # atomic: processes building at once each leave a whole file
    return path


def load_checked(source_path: Path, what: str, wrap: Callable[[ctypes.CDLL], K]) -> tuple[K | None, str]:
    """`wrap` of the loaded library of `source_path` (built now or found built), or None and why.

    `wrap` binds the library's functions and checks them, raising Unavailable (no such kernel on this
    CPU) or one of BUILD_ERRORS (a wrong result). The reason is the Unavailable message or "kernel
    failed: ..."; it is logged once, as info or as a warning."""
    try:
        return wrap(ctypes.CDLL(str(build(source_path, what)))), ""
    except Unavailable as e:
        log.info("%s not used: %s", what, e)
        return None, str(e)
    except BUILD_ERRORS as e:
        log.warning("%s not used (torch's ops instead): %s", what, e)
        return None, f"kernel failed: {e}"
