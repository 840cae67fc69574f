"""Seconds per policy version end to end, with an embedded server generating: files vs distributed.

    python benchmarks/bench_weights_e2e.py [--model moe-50m] [--versions 3] [--step-rel 1e-4] [--write]

One trainer process (random weights, bf16 serving) and one embedded inference server (its own
process, `asyncrl inference`, bf16) that generates all along: a client thread keeps 4 requests
of 64 tokens in flight. Per version, after a synthetic step (every weight moved by a Gaussian of
relative size `--step-rel`), from the trainer's start to `/update_weights` answering:

- files: `FilesystemWeightPublisher` writes the version, then `/update_weights {path}` reads it;
- distributed, dense and delta: `DistributedWeightPublisher` sends it over the server's update
  channel (`[weights] delta` false / true), then `/update_weights {transport: distributed}` swaps
  in what the server received.

Reported per mode (median over the versions): the update's wall time, the pause the server saw
(`paused_seconds`: generation stopped for the swap), the server's load time (files: the read;
distributed: the wait for the staged version and its conversion), and MB per version (files: the
directory; distributed: the payload sent). Results go to BENCHMARKS.md under
"## Weight transfer (embedded server)" with --write.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

from asyncrl.config.trainer import PublishConfig
from asyncrl.config.weights import DistributedWeightsConfig
from asyncrl.distributed import DistInfo
from asyncrl.model import Transformer, from_pretrained
from asyncrl.run_dir import weights_dir
from asyncrl.tools.init_model import init_model
from asyncrl.trainer.publish import FilesystemWeightPublisher
from asyncrl.trainer.publish_distributed import DistributedWeightPublisher
from report import write_section

REPO = Path(__file__).resolve().parents[1]
MODES = ("files", "dense", "delta")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _step(model: Transformer, rel: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * rel * p.abs())


class _Server:
    """`asyncrl inference` in a child process, and a thread that keeps it generating."""

    def __init__(self, model_dir: Path, store_port: int | None, log: Path) -> None:
        self.port = _free_port()
        argv = [
            sys.executable,
            "-m",
            "asyncrl",
            "inference",
            "--model",
            str(model_dir),
            "--port",
            str(self.port),
        ]
        argv += [
            "--dtype",
            "bfloat16",
            "--device",
            "cpu",
            "--kv_cache_tokens",
            "16384",
            "--log_level",
            "warning",
        ]
        if store_port is not None:
            argv += ["--weights.transport", "distributed", "--weights.endpoint", f"127.0.0.1:{store_port}"]
        env = os.environ | {"PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=600)
        self._stop = threading.Event()
        self._wait_ready()
        self._load = [threading.Thread(target=self._generate, daemon=True) for _ in range(4)]
        for t in self._load:
            t.start()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "the server exited; see its log"
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError("the server did not start")

    def _generate(self) -> None:
        body = {"prompt_token_ids": list(range(5, 37)), "max_tokens": 64, "ignore_eos": True}
        while not self._stop.is_set():
            self.http.post("/v1/generate", json=body)

    def update(self, body: dict) -> dict:
        answer = self.http.post("/update_weights", json=body)
        answer.raise_for_status()
        return answer.json()

    def close(self) -> None:
        self._stop.set()
        self.proc.terminate()
        self.proc.wait(timeout=60)


def run_mode(
    mode: str, preset: str, versions: int, step_rel: float, tmp: Path, bucket_bytes: int = 256 << 20
) -> dict:
    base = tmp / f"base-{mode}"
    init_model(preset, base, seed=0)
    model = from_pretrained(base)
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    cfg = PublishConfig(dtype="bfloat16", keep_last=2, overlap=False)
    run = tmp / f"run-{mode}"
    store_port = _free_port()
    if mode == "files":
        publisher = FilesystemWeightPublisher(run, base, cfg, info)
    else:
        weights = DistributedWeightsConfig(
            endpoint=f"127.0.0.1:{store_port}", delta=mode == "delta", bucket_bytes=bucket_bytes
        )
        publisher = DistributedWeightPublisher(run, base, cfg, weights, info, model, 0)
    server = _Server(base, None if mode == "files" else store_port, tmp / f"server-{mode}.log")
    rows = []
    try:
        if mode != "files":  # the server joined and holds v0, the base of the first delta
            server.update({"path": str(base), "version": 0, "transport": "distributed"})
        for version in range(1, versions + 1):
            _step(model, step_rel)
            t0 = time.perf_counter()
            publisher.publish(model, version)
            publisher.wait()
            path = str(weights_dir(run, version).resolve())
            body = {"path": path, "version": version}
            if mode != "files":
                body["transport"] = "distributed"
            answer = server.update(body)
            wall = time.perf_counter() - t0
            rows.append(answer | {"wall_s": wall, "mb": _mb(run, version, mode)})
    finally:
        server.close()
        publisher.close()
    return {
        "mode": mode,
        "wall_s": statistics.median(r["wall_s"] for r in rows),
        "paused_s": statistics.median(r["paused_seconds"] for r in rows),
        "load_s": statistics.median(r["load_seconds"] for r in rows),
        "mb": statistics.median(r["mb"] for r in rows),
    }


def _mb(run: Path, version: int, mode: str) -> float:
    path = weights_dir(run, version)
    if mode == "files":
        return sum(f.stat().st_size for f in path.resolve().iterdir()) / 1e6
    return json.loads((path / "manifest.json").read_text())["num_bytes"] / 1e6


def _ratio(files: dict | None, row: dict) -> str:
    return "-" if files is None else f"{files['wall_s'] / row['wall_s']:.1f}x"


def _table(preset: str, rows: list[dict]) -> str:
    files = next((r for r in rows if r["mode"] == "files"), None)
    out = [
        "| model | mode | update wall s | files / this | server pause ms | server load s | MB per version |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {preset} | {r['mode']} | {r['wall_s']:.2f} | {_ratio(files, r)} | "
            f"{r['paused_s'] * 1e3:.1f} | {r['load_s']:.2f} | {r['mb']:.1f} |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="moe-50m")
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--step-rel", type=float, default=1e-4)
    ap.add_argument("--bucket-mb", type=int, default=256, help="[weights] bucket_bytes, in MiB")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--write", action="store_true")
    a = ap.parse_args()
    if a.write and "files" not in a.modes:
        ap.error("--write needs the files mode: the table's ratios are to it")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run_mode(m, a.model, a.versions, a.step_rel, Path(tmp), a.bucket_mb << 20) for m in a.modes]
    table = _table(a.model, rows)
    print(table)
    if a.write:
        load = os.getloadavg()[0]
        body = (
            "## Weight transfer (embedded server)\n\n"
            f"Seconds per version (median of {a.versions}) from the trainer's start to `/update_weights` "
            "answering, one trainer process and one embedded server (bf16) generating all along (4 requests "
            "of 64 tokens in flight): files (written, then read by the server) vs the distributed transport "
            "(`[weights] delta` false: dense; true: delta), after a synthetic step (each weight moved by a "
            f"Gaussian of relative size {a.step_rel:g}). The pause is how long generation stopped for the "
            "swap; the load is the server's read (files) or its wait for the received version and its "
            "conversion (distributed).\n"
            f"Machine: {platform.machine()}, {os.cpu_count()} cores, shared (1-min load average "
            f"{load:.1f} at the end), torch {torch.__version__}.\n"
            f"Command: `python benchmarks/bench_weights_e2e.py --model {a.model} --versions {a.versions} "
            f"--bucket-mb {a.bucket_mb} --write`\n\n" + table + "\n"
        )
        write_section("## Weight transfer (embedded server)", body)


if __name__ == "__main__":
    main()
