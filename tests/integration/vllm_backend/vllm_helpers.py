"""Helpers of the vLLM tests: where vLLM's interpreter is, and a live vLLM server over a model.

Tests here are marked `vllm` and skip, saying why, when the vLLM interpreter lacks vLLM
(`bash scripts/setup-vllm.sh` installs it; ASYNCRL_VLLM_PYTHON points at another one). vLLM's
start-up takes 1-3 minutes on 2 cores, so one server serves a whole module (conftest.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from asyncrl.config import InferenceConfig
from asyncrl.launcher.vllm import build_vllm_command
from helpers import free_port

REPO = Path(__file__).resolve().parents[3]
VLLM_PYTHON = os.environ.get("ASYNCRL_VLLM_PYTHON", str(REPO / ".venv-vllm" / "bin" / "python"))


def _has_vllm(python: str) -> bool:
    if not Path(python).exists():
        return False
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    return subprocess.run([python, "-c", probe], capture_output=True, check=False).returncode == 0


HAS_VLLM = _has_vllm(VLLM_PYTHON)
NO_VLLM = f"vLLM is not installed in {VLLM_PYTHON} (run `bash scripts/setup-vllm.sh`)"


@dataclass
class VLLMServer:
    url: str
    model_dir: Path
    log: Path


@contextlib.contextmanager
def vllm_server(model_dir: Path, log: Path, **overrides) -> Iterator[VLLMServer]:
    """A vLLM server on 127.0.0.1 started with the launcher's own command; stopped with its group."""
    cfg = InferenceConfig(
        **{
            "model": str(model_dir),
            "backend": "vllm",
            "port": free_port(),
            "dtype": "bfloat16",
            "max_num_seqs": 16,
            "max_model_len": 2048,
            "log_level": "warning",
            "vllm": {"cpu_kv_cache_space_gb": 1, "enforce_eager": True},
        }
        | overrides
    )
    command = build_vllm_command(cfg, python=VLLM_PYTHON)
    with log.open("w") as out:
        proc = subprocess.Popen(
            command.argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=os.environ | command.env,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{cfg.port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, f"vLLM exited with {proc.returncode}; log: {log}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, f"vLLM not healthy after 600 s; log: {log}"
            time.sleep(1)
        yield VLLMServer(url=url, model_dir=model_dir, log=log)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
