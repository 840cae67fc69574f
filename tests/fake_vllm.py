"""A stand-in for vLLM's server processes, for the Slurm jobs `asyncrl rl --slurm` renders with
`backend = "vllm"`, on a machine where vLLM's CPU build cannot run data parallelism across processes
or a KV connector.

    [inference.vllm] python = "bin/vllm-python"   # a shim: exec python tests/fake_vllm.py "$@"

It takes the command line the job gives vLLM (`-m vllm.entrypoints.openai.api_server ...` for a
group's head, `-m vllm.entrypoints.cli.main serve ... --headless` for a follower) and honours the
parts asyncrl renders:

- a head of a group spread over nodes (`--data-parallel-size-local` < `--data-parallel-size`)
  listens on `--data-parallel-rpc-port` and waits, as vLLM's head does, for a follower from each of
  the group's other nodes: each connects to `--data-parallel-address`:`--data-parallel-rpc-port`
  and says its `--data-parallel-start-rank`; the head checks the ranks are the group's and only
  then serves HTTP on `--port`;
- the head serves with asyncrl's embedded engine (one, however many engines the group has) the
  endpoints `VLLMBackend` uses: `/inference/v1/generate` (with `kv_transfer_params`: the embedded
  server's no-op handoff, docs/inference.md), `/pause`, `/resume`, `/health`, `/metrics`,
  `/collective_rpc` (`asyncrl_reload_weights` records the path) and `/update_weight_version`
  (loads it, labelled with the version), `/weight_info`;
- a follower holds its connection until the head closes it, then exits.

Every process appends one JSON line to $FAKE_VLLM_LOG: its node, CUDA_VISIBLE_DEVICES, role, port,
ranks, and `--kv-transfer-config`.
"""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations (Request), imported
# inside _serve so that a follower never loads the engine.
import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

# The job sets vLLM's PYTHONPATH to the worker extension's folder alone: serve this checkout's engine.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

_ARGS = (
    "--model",
    "--port",
    "--host",
    "--seed",
    "--dtype",
    "--max-num-seqs",
    "--max-model-len",
    "--data-parallel-size",
    "--data-parallel-size-local",
    "--data-parallel-address",
    "--data-parallel-rpc-port",
    "--data-parallel-start-rank",
    "--kv-transfer-config",
)


def _parse(argv: list[str]) -> argparse.Namespace:
    if argv[:2] == ["-m", "vllm.entrypoints.openai.api_server"]:
        argv = argv[2:]
    elif argv[:3] == ["-m", "vllm.entrypoints.cli.main", "serve"]:
        argv = argv[3:]
    else:
        raise SystemExit(f"fake vllm: unexpected entry point {argv[:3]}")
    p = argparse.ArgumentParser(prog="fake-vllm", allow_abbrev=False)
    for flag in _ARGS:
        p.add_argument(flag)
    p.add_argument("--headless", action="store_true")
    args, _ = p.parse_known_args(argv)
    return args


def _record(args: argparse.Namespace) -> None:
    line = {
        "node": os.environ.get("SLURMD_NODENAME"),
        "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "headless": args.headless,
        "port": args.port,
        "dp": args.data_parallel_size,
        "dp_local": args.data_parallel_size_local,
        "address": args.data_parallel_address,
        "rpc_port": args.data_parallel_rpc_port,
        "start_rank": args.data_parallel_start_rank,
        "kv_transfer_config": json.loads(args.kv_transfer_config) if args.kv_transfer_config else None,
    }
    with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
        f.write(json.dumps(line) + "\n")


def _follow(args: argparse.Namespace) -> int:
    """Hand this node's engines to the head, then live as long as the head's connection does."""
    deadline = time.monotonic() + 300
    while True:
        try:
            conn = socket.create_connection((args.data_parallel_address, int(args.data_parallel_rpc_port)))
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    conn.sendall(f"{args.data_parallel_start_rank}\n".encode())
    while conn.recv(1024):
        pass
    return 0


def _gather_followers(args: argparse.Namespace) -> list[socket.socket]:
    """Wait for a follower from every other node of the group; each must bring its node's first rank."""
    size, local = int(args.data_parallel_size or 1), int(args.data_parallel_size_local or 0)
    if not local or local == size:
        return []
    server = socket.create_server(("0.0.0.0", int(args.data_parallel_rpc_port)))
    conns, ranks = [], []
    for _ in range(size // local - 1):
        conn, _ = server.accept()
        ranks.append(int(conn.makefile().readline()))
        conns.append(conn)
    want = list(range(local, size, local))
    if sorted(ranks) != want:
        raise SystemExit(f"fake vllm: followers brought ranks {sorted(ranks)}, the group needs {want}")
    return conns


def _serve(args: argparse.Namespace) -> None:
    import uvicorn
    from fastapi import Request

    from asyncrl.config import InferenceConfig
    from asyncrl.inference.main import build_server_app

    config = InferenceConfig(
        model=args.model,
        host=args.host,
        port=int(args.port),
        seed=int(args.seed or 0),
        max_num_seqs=int(args.max_num_seqs or 64),
        max_model_len=int(args.max_model_len) if args.max_model_len else None,
        api_key=os.environ.get("VLLM_API_KEY"),
        update_weights_roots=[str(Path.cwd())],
    )
    app = build_server_app(config)
    engine = app.state.server.engine
    pending: dict[str, str] = {}

    @app.post("/collective_rpc")
    async def collective_rpc(request: Request) -> dict:
        body = await request.json()
        assert body["method"] == "asyncrl_reload_weights", body
        pending["path"] = body["kwargs"]["weights_path"]
        return {"results": [None]}

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> dict:
        version = int((await request.json())["new_version"])
        await engine.update_weights(pending.pop("path"), version, "keep")
        return {"success": True, "new_version": str(version)}

    @app.get("/weight_info")
    async def weight_info() -> dict:
        version = engine.engine.version
        return {"weight_version": str(version) if version else "default"}

    uvicorn.run(app, host=config.host, port=config.port, log_level="warning")


def main(argv: list[str]) -> int:
    args = _parse(argv)
    _record(args)
    if args.headless:
        return _follow(args)
    followers = _gather_followers(args)
    try:
        _serve(args)
    finally:
        for conn in followers:
            conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
