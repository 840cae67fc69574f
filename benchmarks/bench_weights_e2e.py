"""Seconds per policy version end to end, with inference servers generating: files vs distributed.

    python benchmarks/bench_weights_e2e.py [--model moe-50m ...] [--backend embedded|vllm] [--servers 1]
        [--world-size 1 ...] [--versions 3] [--step-rel 1e-4] [--modes files dense delta] [--write]

A trainer of W processes (`--world-size`, gloo, one thread each, FSDP2 over them when W > 1; its
weights are the base model's, each rank reading its own shards) and inference servers that generate
all along: a client thread per request keeps 4 requests of 64 tokens in flight on each server.
`--backend embedded`: `--servers N` servers `asyncrl inference` (bf16); `--backend vllm`: one vLLM
server from `.venv-vllm` (bf16, eager, CPU build), started with the command `asyncrl rl` builds
(`asyncrl.launcher.vllm.build_vllm_command`). Every server has its own update channel. Per version,
after a synthetic step (every weight moved by a Gaussian of relative size `--step-rel`), from the
trainer's start to the last server's `update_weights` answering (`asyncrl.client` backends, all
servers at once, as the orchestrator's weight updater asks them):

- files: `FilesystemWeightPublisher` writes the version (every rank its share), then each server
  reads it (vLLM: its in-place reload, through asyncrl's worker extension);
- distributed, dense and delta: `DistributedWeightPublisher` sends it from every rank over each
  server's channel (`[weights] delta` false / true), then each server swaps in what it received.

Reported per case (median over the versions): the update's wall time, the pause each server saw
and the largest, the largest load time (files: the read; distributed: the wait for the staged
version and its conversion), and MB moved per version (files: the directory written once and read
by every server; distributed: the payload sent, over all trainer ranks and servers). The pause is
the embedded server's own count (generation stopped for the swap, between two engine steps), or
for vLLM the client's, from `/pause?mode=keep` to `/resume` answering (vLLM schedules no step in
between; running requests keep their KV). Results go to BENCHMARKS.md under
"## Weight transfer (end to end, embedded servers)" or "... (end to end, vLLM)" with --write.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import httpx
import tomli_w
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from asyncrl.client import build_backends
from asyncrl.config import InferenceConfig
from asyncrl.config.trainer import PublishConfig
from asyncrl.config.weights import DistributedWeightsConfig
from asyncrl.distributed import DistInfo, ParallelDims, apply_parallelism, load_hf_shards
from asyncrl.launcher.vllm import build_vllm_command
from asyncrl.model import Transformer, load_args
from asyncrl.model.hf import HFReader, build_meta_model
from asyncrl.run_dir import weights_dir
from asyncrl.tools.init_model import init_model
from asyncrl.trainer.publish import FilesystemWeightPublisher
from asyncrl.trainer.publish_distributed import DistributedWeightPublisher
from asyncrl.transport.weights import wait_for_weights
from asyncrl.wire import GenerateRequest, UpdateWeightsRequest
from asyncrl.wire.vllm import to_vllm_generate
from report import machine, write_section

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
MODES = ("files", "dense", "delta")
TITLES = {
    "embedded": "## Weight transfer (end to end, embedded servers)",
    "vllm": "## Weight transfer (end to end, vLLM)",
}
_TIMEOUT_S = 900.0  # one version, a model's load or a server's start on a shared 2-core machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the trainer: W processes, each publishing its own shards ------------------------------------
def _load_model(base: Path, world_size: int) -> Transformer:
    with HFReader(base, load_args(base)) as reader:
        model = build_meta_model(reader, torch.float32)
        if world_size > 1:
            dims = ParallelDims.build(world_size=world_size, num_experts=model.args.num_experts)
            apply_parallelism(model, dims, dims.build_meshes("cpu"), device_type="cpu")
        model.to_empty(device="cpu")
        model.tie_weights()
        load_hf_shards(model, reader, where=str(base))
    return model


def _step(model: Transformer, rel: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * rel * p.abs())


def _trainer(rank: int, job: dict, commands: list, results: mp.Queue) -> None:
    """One trainer rank: publish each version the driver asks for; rank 0 reports its start time."""
    torch.set_num_threads(1)
    # the synthetic step's randn_like on DTensors: one warning per rank and parameter otherwise
    warnings.filterwarnings("ignore", message="DTensor random operators")
    world_size, base = job["world_size"], Path(job["base"])
    if world_size > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job["dist_port"]))
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    model = _load_model(base, world_size)
    info = DistInfo(rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"))
    cfg = PublishConfig(dtype="bfloat16", keep_last=2, overlap=False)
    if job["mode"] == "files":
        publisher = FilesystemWeightPublisher(Path(job["run"]), base, cfg, info)
    else:
        weights = DistributedWeightsConfig(
            endpoint=job["endpoint"], delta=job["mode"] == "delta", bucket_bytes=job["bucket_bytes"]
        )
        publisher = DistributedWeightPublisher(Path(job["run"]), base, cfg, weights, info, model, 0)
    try:
        while (version := commands[rank].get()) is not None:
            _step(model, job["step_rel"])
            if world_size > 1:
                dist.barrier()
            t0 = time.time()
            publisher.publish(model, version)
            publisher.wait()  # collective: every rank's share is out
            if rank == 0:
                results.put(t0)
    finally:
        publisher.close()
        if world_size > 1:
            dist.destroy_process_group()


class _Trainer:
    """The trainer's processes (spawned: the driver runs threads) and the queues that drive them."""

    def __init__(self, job: dict) -> None:
        ctx = mp.get_context("spawn")
        self.commands = [ctx.Queue() for _ in range(job["world_size"])]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(target=_trainer, args=(rank, job, self.commands, self.results), daemon=True)
            for rank in range(job["world_size"])
        ]
        for p in self.procs:
            p.start()

    def publish(self, version: int) -> float:
        """Publish `version` on every rank; the time rank 0 started it."""
        for q in self.commands:
            q.put(version)
        deadline = time.monotonic() + _TIMEOUT_S
        while True:
            try:
                return self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [p.exitcode for p in self.procs if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the trainer did not publish v{version} (exit codes {dead})"
                    ) from None

    def close(self) -> None:
        for q in self.commands:
            q.put(None)
        for p in self.procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


# -- the servers ----------------------------------------------------------------------------------
def _server_config(base: Path, backend: str, index: int, endpoint: str | None) -> InferenceConfig:
    weights = {"transport": "filesystem"}
    if endpoint is not None:
        weights = {"transport": "distributed", "endpoint": endpoint, "timeout_s": _TIMEOUT_S}
    common = {"model": str(base), "backend": backend, "port": _free_port(), "dtype": "bfloat16"}
    common |= {"log_level": "warning", "weights": weights, "weights_server": f"server{index}"}
    if backend == "vllm":
        vllm = {"cpu_kv_cache_space_gb": 1, "enforce_eager": True, "python": str(VLLM_PYTHON)}
        return InferenceConfig(**common, max_num_seqs=16, max_model_len=2048, vllm=vllm)
    return InferenceConfig(**common, device="cpu", kv_cache_tokens=16384)


class _Server:
    """One inference server in its own process group, and the threads that keep it generating."""

    def __init__(self, cfg: InferenceConfig, tmp: Path) -> None:
        self.cfg, self.url = cfg, f"http://127.0.0.1:{cfg.port}"
        log = tmp / f"{cfg.weights_server}.log"
        if cfg.backend == "vllm":
            command = build_vllm_command(cfg, python=cfg.vllm.python)
            argv, env = command.argv, command.env
        else:
            path = tmp / f"{cfg.weights_server}.toml"
            path.write_text(tomli_w.dumps(cfg.model_dump(mode="json", exclude_none=True)))
            argv = [sys.executable, "-m", "asyncrl", "inference", "@", str(path)]
            env = {"PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
        with log.open("w") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=os.environ | env, start_new_session=True
            )
        self.http = httpx.Client(base_url=self.url, timeout=_TIMEOUT_S)
        self._stop, self._warm = threading.Event(), threading.Event()
        self._wait_ready(log)
        self._load = [threading.Thread(target=self._generate, daemon=True) for _ in range(4)]
        for t in self._load:
            t.start()
        # vLLM's first steps are slow (kernels set up on first use): measure from a warm server
        if not self._warm.wait(_TIMEOUT_S):
            raise TimeoutError(f"no request finished on the server; see {log}")

    def _wait_ready(self, log: Path) -> None:
        deadline = time.monotonic() + _TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the server exited; see {log}"
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the server did not start; see {log}")

    def _generate(self) -> None:
        request = GenerateRequest(prompt_token_ids=list(range(5, 37)), max_tokens=64, ignore_eos=True)
        path, body = "/v1/generate", request.model_dump(mode="json", exclude_none=True)
        if self.cfg.backend == "vllm":
            path, body = "/inference/v1/generate", to_vllm_generate(request)
        while not self._stop.is_set():
            try:
                self.http.post(path, json=body).raise_for_status()
                self._warm.set()
            except httpx.HTTPError:
                if self._stop.is_set():
                    return
                raise

    def close(self) -> None:
        self._stop.set()
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            # vLLM's HTTP server, its engine gone, waits for the requests still open on it
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass


async def _update(backends: list, path: str, version: int, mode: str) -> list:
    """Every server loads `version` at once, as the orchestrator's weight updater asks them."""
    transport = "filesystem" if mode == "files" else "distributed"
    request = UpdateWeightsRequest(path=path, version=version, transport=transport)
    return list(await asyncio.gather(*(b.update_weights(request) for b in backends)))


# -- one case: a model, a backend, N servers, a trainer of W ranks, a mode -------------------------
def run_case(case: dict, versions: int, step_rel: float, tmp: Path) -> dict:
    name = f"{case['model']}-{case['backend']}-w{case['world_size']}-{case['mode']}"
    base, run = tmp / f"base-{case['model']}", tmp / f"run-{name}"
    if not base.exists():
        init_model(case["model"], base, seed=0)
    endpoint = None if case["mode"] == "files" else f"127.0.0.1:{_free_port()}"
    job = case | {"base": str(base), "run": str(run), "endpoint": endpoint, "step_rel": step_rel}
    trainer = _Trainer(job | {"dist_port": _free_port()})
    servers: list[_Server] = []
    try:
        for i in range(case["servers"]):
            (tmp / name).mkdir(exist_ok=True)
            servers.append(_Server(_server_config(base, case["backend"], i, endpoint), tmp / name))
        rows = asyncio.run(_drive(trainer, servers, case["mode"], base, run, versions))
    finally:
        for s in servers:
            s.close()
        trainer.close()
    return case | _summarise(rows)


async def _drive(trainer: _Trainer, servers: list, mode: str, base: Path, run: Path, versions: int) -> list:
    backends = build_backends([s.url for s in servers], kind=servers[0].cfg.backend, timeout_s=_TIMEOUT_S)
    if mode != "files":  # every server joined and holds v0, the base of the first delta
        await _update(backends, str(base), 0, mode)
    rows = []
    for version in range(1, versions + 1):
        t0 = await asyncio.to_thread(trainer.publish, version)
        path = await asyncio.to_thread(wait_for_weights, run, version, _TIMEOUT_S)
        answers = await _update(backends, str(path.resolve()), version, mode)
        wall = time.time() - t0
        rows.append({"wall_s": wall, "answers": answers, "mb": _mb(run, version, mode, len(servers))})
    for b in backends:
        await b.aclose()
    return rows


def _mb(run: Path, version: int, mode: str, num_servers: int) -> float:
    path = weights_dir(run, version)
    if mode == "files":  # written once, read by every server
        return (1 + num_servers) * sum(f.stat().st_size for f in path.resolve().iterdir()) / 1e6
    return json.loads((path / "manifest.json").read_text())["num_bytes"] / 1e6


def _summarise(rows: list[dict]) -> dict:
    num_servers = len(rows[0]["answers"])
    pauses = [statistics.median(r["answers"][i].paused_seconds for r in rows) for i in range(num_servers)]
    loads = [statistics.median(r["answers"][i].load_seconds for r in rows) for i in range(num_servers)]
    return {
        "wall_s": statistics.median(r["wall_s"] for r in rows),
        "paused_s": pauses,
        "load_s": max(loads),
        "mb": statistics.median(r["mb"] for r in rows),
    }


def _files_row(rows: list[dict], row: dict) -> dict | None:
    """The files case with the same model and trainer ranks as `row`: its ratio's baseline."""
    same = ("model", "world_size")
    return next((r for r in rows if r["mode"] == "files" and all(r[k] == row[k] for k in same)), None)


def _ratio(files: dict | None, row: dict) -> str:
    return "-" if files is None else f"{files['wall_s'] / row['wall_s']:.1f}x"


def _table(rows: list[dict]) -> str:
    out = [
        "| model | servers | trainer ranks | mode | update wall s | files / this | pause ms, max | "
        "pause ms, each server | load s, max | MB moved per version |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        files = _files_row(rows, r)
        each = " / ".join(f"{p * 1e3:.1f}" for p in r["paused_s"])
        out.append(
            f"| {r['model']} | {r['servers']} | {r['world_size']} | {r['mode']} | {r['wall_s']:.2f} | "
            f"{_ratio(files, r)} | {max(r['paused_s']) * 1e3:.1f} | {each} | {r['load_s']:.2f} | "
            f"{r['mb']:.1f} |"
        )
    return "\n".join(out)


def _command() -> str:
    """The command line as it was typed (the table is only what those options measured)."""
    return shlex.join(["python", "benchmarks/bench_weights_e2e.py", *sys.argv[1:]])


def _section(a: argparse.Namespace, table: str, minutes: float) -> str:
    if a.backend == "vllm":
        who = (
            f"{a.servers} vLLM server(s) (`.venv-vllm`, CPU build, bf16, eager; the command `asyncrl rl` "
            "builds); the pause is the client's, from `/pause?mode=keep` to `/resume` answering (vLLM runs "
            "no engine step in between; running requests keep their KV); the load is the reload from the "
            "files (files) or the wait for the received version and the swap (distributed)"
        )
    else:
        who = (
            f"{a.servers} embedded server(s) (bf16, one thread each); the pause is how long generation "
            "stopped for the swap; the load is the server's read (files) or its wait for the received "
            "version and its conversion (distributed)"
        )
    return (
        f"{TITLES[a.backend]}\n\n"
        f"Seconds per version (median of {a.versions}) from the trainer's start to the last server's "
        "`update_weights` answering (all servers asked at once), with every server generating all along "
        "(4 requests of 64 tokens in flight each): files (every trainer rank writes its share, each server "
        "reads the directory) vs the distributed transport (`[weights] delta` false: dense; true: delta; "
        "every server its own update channel), after a synthetic step (each weight moved by a Gaussian of "
        f"relative size {a.step_rel:g}). Trainer: W gloo processes, one thread each, FSDP2 when W > 1. "
        f"{who}. MB moved: files, the directory written once plus each server's read; distributed, the "
        "payload sent over all trainer ranks and servers.\n"
        f"Machine: {machine()}; 1-min load average {os.getloadavg()[0]:.1f} at the end; torch "
        f"{torch.__version__}; {minutes:.0f} min in all.\n"
        f"Command: `{_command()}`\n\n" + table + "\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", nargs="+", default=["moe-50m"])
    ap.add_argument("--backend", choices=tuple(TITLES), default="embedded")
    ap.add_argument("--servers", type=int, default=1)
    ap.add_argument("--world-size", nargs="+", type=int, default=[1])
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--step-rel", type=float, default=1e-4)
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--bucket-mb", type=int, default=256, help="[weights] bucket_bytes, in MiB")
    ap.add_argument("--write", action="store_true")
    a = ap.parse_args()
    if a.write and "files" not in a.modes:
        ap.error("--write needs the files mode: the table's ratios are to it")
    if a.backend == "vllm" and not VLLM_PYTHON.exists():
        ap.error(f"--backend vllm needs vLLM's interpreter at {VLLM_PYTHON} (bash scripts/setup-vllm.sh)")
    torch.set_num_threads(1)
    start, rows = time.monotonic(), []
    with tempfile.TemporaryDirectory() as tmp:
        for case in _cases(a):
            rows.append(run_case(case, a.versions, a.step_rel, Path(tmp)))
            print(_table(rows).splitlines()[-1], flush=True)
            if a.write:  # after each case: a long matrix stopped midway keeps what it measured
                write_section(TITLES[a.backend], _section(a, _table(rows), (time.monotonic() - start) / 60))
    print(_table(rows))


def _cases(a: argparse.Namespace) -> list[dict]:
    common = {"backend": a.backend, "servers": a.servers, "bucket_bytes": a.bucket_mb << 20}
    return [
        common | {"model": model, "world_size": world_size, "mode": mode}
        for model in a.model
        for world_size in a.world_size
        for mode in a.modes
    ]


if __name__ == "__main__":
    main()
