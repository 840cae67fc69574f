"""The GPU check's `weights` section: one policy version over an update channel between two processes.

The trainer's side (`BucketSender`, channel rank 0) and a server's side (`BucketReceiver`, channel
rank 1) run in two processes spawned on this node, as `[weights] transport = "distributed"` runs
them: NCCL with one GPU each on a CUDA device (the section is skipped, saying so, on a node with
fewer than two GPUs: NCCL refuses two ranks on one GPU), gloo on the CPU (`--device cpu`). The
sender's model is drawn at random in fp32 and sent in bf16; the receiver's version must be the
sender's serving tensors bit for bit (a digest of each side), and the section reports the payload
and the sender's seconds for the whole version (snapshot, buckets, acks).
"""

from __future__ import annotations

import hashlib
import multiprocessing as std_mp
import socket
import time
from typing import Any

import torch

from asyncrl.model import ModelArgs, Transformer
from asyncrl.model.serving import serving_format
from gpu_check_sections import Check, Ctx, Section, build_random_model

SERVING = torch.bfloat16
BUCKET_BYTES = 64 << 20
TIMEOUT_S = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        h.update(name.encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _worker(rank: int, args: ModelArgs, device_type: str, port: int, seed: int, out: Any) -> None:
    """Channel rank 0 sends version 1 of a random model; rank 1 receives it. Puts a dict on `out`."""
    from asyncrl.weight_transfer import BucketReceiver, BucketSender, Channel, Rendezvous, published_shapes

    try:
        device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        rdv = Rendezvous(host="127.0.0.1", port=port, num_senders=1, world_size=2, name="gpu-check")
        channel = Channel.join(rdv, rank=rank, device=device, timeout_s=TIMEOUT_S)
        if rank == 0:
            model = build_random_model(args, device, torch.float32, seed)
            fmt = serving_format(model, SERVING)
            t0 = time.perf_counter()
            stats = BucketSender(bucket_bytes=BUCKET_BYTES, delta=False).send(model, fmt, 1, {"s": channel})
            seconds = time.perf_counter() - t0
            sent = stats["s"]
            if isinstance(sent, Exception):
                raise sent
            expected = {
                n: t.to(SERVING) for n, t in model.state_dict().items() if n in published_shapes(model, fmt)
            }
            out.put({"rank": 0, "digest": _digest(expected), "seconds": seconds, "bytes": sent.num_bytes})
        else:
            with torch.device("meta"):
                meta = Transformer(args)
            receiver = BucketReceiver(channel, published_shapes(meta, serving_format(meta, SERVING)))
            version, state = receiver.receive(timeout_s=TIMEOUT_S)
            out.put({"rank": 1, "digest": _digest(state), "version": version})
    except Exception as e:  # reported by the parent, which owns the section's outcome
        out.put({"rank": rank, "error": f"{type(e).__name__}: {e}"})


def weights_section(ctx: Ctx) -> Section:
    """One version from a sender process to a receiver process over NCCL (GPU) or gloo (CPU)."""
    device_type = ctx.device.type
    if device_type == "cuda" and torch.cuda.device_count() < 2:
        reason = f"NCCL needs one GPU per process and this node has {torch.cuda.device_count()}"
        return Section(checks={"bit_identical": Check(passed=None, skipped=reason)})
    spawn = std_mp.get_context("spawn")  # CUDA is initialised in this process already
    out = spawn.Queue()
    port = _free_port()
    args = ctx.sizes.weights_model
    procs = [
        spawn.Process(target=_worker, args=(rank, args, device_type, port, ctx.seed, out)) for rank in (0, 1)
    ]
    for p in procs:
        p.start()
    try:
        results = {r["rank"]: r for r in (out.get(timeout=max(ctx.time_left(), 10.0)) for _ in procs)}
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = [f"rank {r}: {res['error']}" for r, res in sorted(results.items()) if "error" in res]
    if errors:
        raise RuntimeError("; ".join(errors))
    sent, got = results[0], results[1]
    mb = sent["bytes"] / 1e6
    return Section(
        metrics={
            "backend": "nccl" if device_type == "cuda" else "gloo",
            "model": ctx.sizes.weights_model_name,
            "serving_dtype": "bfloat16",
            "mb_per_version": round(mb, 1),
            "send_s": round(sent["seconds"], 3),
            "mb_per_s": round(mb / sent["seconds"], 1),
        },
        checks={"bit_identical": Check(passed=sent["digest"] == got["digest"] and got["version"] == 1)},
    )
