"""Router-replay payload per turn: bytes on the wire and the orchestrator's decode time, before and after.

    PYTHONPATH=src python benchmarks/bench_r3_payload.py --baseline-src /tmp/base/src [--write]

One multi-turn episode per context length (`--contexts`, default 8192 and 32768 tokens): `--turns`
turns, each adding its share of environment tokens and `--completion` sampled tokens, so the last
turn's context is the whole length. Each turn's request is built as the orchestrator builds it
(`TrajectoryBuilder.routing_start` as `routed_experts_start`; for vLLM, `to_vllm_generate`), the
answer's body is encoded as the server encodes it, and the orchestrator's side is timed: the body
parsed into a `GenerateResponse` (as `HttpBackend` / `VLLMBackend` parse it) and its rows placed in
the trajectory. Paths:

- `embedded, JSON`: `/v1/generate` as JSON, routing in base64 (the fallback for other clients);
- `embedded, binary`: the binary body `HttpBackend` asks for (`asyncrl.wire.binary`);
- `vLLM`: vLLM 0.32's answer, an `.npy` in base64 from the start the request names
  (`sampling_params.routed_experts_prompt_start`; a request without it gets the whole context).

Routing ids are random in the expert range, of the model's shape (`--shapes`: `tiny-glm5-32k`,
4 layers x top-2 of 8 experts, and `glm5`, 78 x top-8 of 256); the episode's assembled routing is
checked against them, bit for bit. With `--baseline-src DIR` (the `src` of a checkout before the
change, e.g. `git worktree add /tmp/base <commit>`) the same episodes run in a child process on that
code too: the "before" rows. Times are medians of `--repeats` episodes. The batch on disk is the
episode's one sample written by `write_batch`. The header extrapolates to one GLM-5 turn at
131072 tokens. With --write the tables replace the `## Router replay payload` section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from report import machine, write_section

SECTION = "## Router replay payload"
SHAPES = {"tiny-glm5-32k": (4, 2, 8), "glm5": (78, 8, 256)}  # layers, top_k, experts
GLM5_TURN_TOKENS = 131072


def _vllm_answer(request_body: dict, full: np.ndarray, completion: list[int]) -> bytes:
    """vLLM 0.32's answer: rows from the requested prompt start to the last token fed forward."""
    num_prompt = len(request_body["token_ids"])
    start = request_body["sampling_params"].get("routed_experts_prompt_start", 0)
    buf = io.BytesIO()
    np.save(buf, full[start : num_prompt + len(completion) - 1], allow_pickle=False)
    choice = {
        "index": 0,
        "finish_reason": "length",
        "token_ids": completion,
        "logprobs": {"content": [{"token_id": t, "logprob": -1.0} for t in completion]},
        "weight_versions": [{"version": "default", "start": 0, "end": len(completion)}],
        "routed_experts": base64.b64encode(buf.getvalue()).decode(),
    }
    return json.dumps({"choices": [choice], "usage": {"prompt_tokens": num_prompt}}).encode()


def _server_answer(request, completion: list[int], routing: np.ndarray):
    """The embedded server's `/v1/generate` answer, as the code under test builds it."""
    from asyncrl.wire import GenerateResponse, RoutedExperts

    try:
        from asyncrl.inference.serving import Collected
    except ImportError:
        Collected = None
    fields = {"token_ids": completion, "logprobs": [-1.0] * len(completion), "finish_reason": "length"}
    if Collected is not None and hasattr(Collected, "to_response"):
        done = Collected(**fields, versions=[0] * len(completion), routed_experts=routing, context_version=0)
        return done.to_response(request)
    start = min(request.routed_experts_start, len(request.prompt_token_ids))
    return GenerateResponse(  # the answer before `to_response`: it repeated the prompt's ids
        **fields,
        policy_versions=[0] * len(completion),
        prompt_token_ids=request.prompt_token_ids,
        routed_experts=RoutedExperts.from_array(routing, start=start),
        context_version=0,
    )


def _codec(path: str, full: np.ndarray):
    """(encode(request, completion) -> body, parse(body, request) -> GenerateResponse) of one path."""
    from asyncrl.wire import GenerateResponse
    from asyncrl.wire.vllm import from_vllm_generate, to_vllm_generate

    def ours(request, completion):
        start = min(request.routed_experts_start, len(request.prompt_token_ids))
        end = len(request.prompt_token_ids) + len(completion)  # the embedded engine routes the last token
        return _server_answer(request, completion, full[start:end])

    if path == "vLLM":
        return (
            lambda req, c: _vllm_answer(to_vllm_generate(req), full, c),
            lambda body, req: from_vllm_generate(json.loads(body), req),
        )
    if path == "embedded, binary":
        from asyncrl.wire.binary import decode_generate, encode_generate

        return lambda req, c: encode_generate(ours(req, c)), lambda body, req: decode_generate(body)
    return (
        lambda req, c: ours(req, c).model_dump_json().encode(),
        lambda body, req: GenerateResponse.model_validate_json(body),
    )


def _episode(path: str, full: np.ndarray, turns: int, completion: int) -> dict:
    """One episode on `path`: per turn bytes, encode and decode seconds; the sample's batch on disk."""
    from asyncrl.envs.trajectory import TrajectoryBuilder
    from asyncrl.transport.rollouts import read_batch, write_batch
    from asyncrl.wire import GenerateRequest, RolloutBatch

    encode, parse = _codec(path, full)
    context = full.shape[0]
    stream = (np.arange(context) % 250 + 1).tolist()
    traj, ids, out = TrajectoryBuilder(), [], {"bytes": [], "encode_s": [], "decode_s": []}
    for k in range(1, turns + 1):
        ids = stream[: k * context // turns - completion]
        prompt = traj.extend_prompt(ids, temperature=1.0)
        request = GenerateRequest(
            prompt_token_ids=prompt,
            max_tokens=completion,
            ignore_eos=True,
            return_routed_experts=True,
            routed_experts_start=traj.routing_start,
        )
        sampled = stream[len(prompt) : len(prompt) + completion]
        t0 = time.thread_time()
        body = encode(request, sampled)
        t1 = time.thread_time()
        traj.add_completion(parse(body, request), temperature=1.0)
        t2 = time.thread_time()
        out["bytes"].append(len(body))
        out["encode_s"].append(t1 - t0)
        out["decode_s"].append(t2 - t1)
    t0 = time.thread_time()
    (sample,) = traj.build(reward=1.0, env="bench", episode_id="e", metrics={})
    out["build_s"] = time.thread_time() - t0
    n = len(sample.token_ids)  # vLLM never routes the last token: the trajectory repeats the row before
    last = full[n - 2] if sample.metrics.get("routing_filled_tokens") else full[n - 1]
    assert sample.routed_experts[:-1].tobytes() == full[: n - 1].tobytes(), f"{path}: routing not exact"
    assert np.array_equal(sample.routed_experts[-1], last), f"{path}: last routing row not exact"
    with tempfile.TemporaryDirectory() as run:
        step_dir = write_batch(run, RolloutBatch(step=0, samples=[sample]))
        out["batch_bytes"] = sum(f.stat().st_size for f in step_dir.iterdir())
        t0 = time.thread_time()
        (back,) = read_batch(run, 0, timeout_s=5).samples
        out["read_s"] = time.thread_time() - t0
    out["routing_bytes"] = int(back.routed_experts.nbytes)
    out["routing_dtype"] = str(back.routed_experts.dtype)
    return out


def _paths() -> list[str]:
    try:
        import asyncrl.wire.binary  # noqa: F401
    except ImportError:
        return ["embedded, JSON", "vLLM"]
    return ["embedded, JSON", "embedded, binary", "vLLM"]


def measure(args: argparse.Namespace) -> list[dict]:
    """One episode per path x shape x context, in this interpreter."""
    rows = []
    for shape in args.shapes:
        layers, top_k, experts = SHAPES[shape]
        for context in args.contexts:
            full = np.random.default_rng(0).integers(0, experts, (context, layers, top_k)).astype(np.uint8)
            for path in _paths():
                run = _episode(path, full, args.turns, args.completion)
                rows.append({"shape": shape, "context": context, "path": path} | run)
    return rows


def _child(src: str, args: argparse.Namespace) -> list[dict]:
    """`measure` on the code in `src`, in a fresh interpreter."""
    cmd = [sys.executable, __file__, "--child", *_forwarded(args)]
    env = os.environ | {"PYTHONPATH": str(Path(src).resolve())}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _medians(runs: list[list[dict]]) -> list[dict]:
    """Per row, the median over runs of each per-turn figure and of the episode's figures."""
    out = []
    for rows in zip(*runs):
        med = dict(rows[0])
        for key in ("bytes", "encode_s", "decode_s"):
            med[key] = [statistics.median(r[key][t] for r in rows) for t in range(len(rows[0][key]))]
        med |= {k: statistics.median(r[k] for r in rows) for k in ("build_s", "read_s")}
        out.append(med)
    return out


def _forwarded(args: argparse.Namespace) -> list[str]:
    return [
        "--contexts", *map(str, args.contexts), "--shapes", *args.shapes, "--turns", str(args.turns),
        "--completion", str(args.completion),
    ]  # fmt: skip


def _mb(n: float) -> str:
    return f"{n / 1e6:.3f}" if n < 1e7 else f"{n / 1e6:.1f}"


def table(before: list[dict], after: list[dict]) -> str:
    """One row per path and run: the last turn (context = the whole length) and the whole episode."""
    lines = [
        "| model | context | path | code | last turn: MB on the wire | last turn: decode CPU ms | "
        "last turn: server encode CPU ms | episode: MB | episode: decode CPU ms (+ build) | batch on disk MB "
        "(routing, dtype) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for code, rows in (("before", before), ("after", after)):
        for r in rows:
            lines.append(
                f"| {r['shape']} | {r['context']} | {r['path']} | {code} | {_mb(r['bytes'][-1])} | "
                f"{r['decode_s'][-1] * 1e3:.2f} | {r['encode_s'][-1] * 1e3:.2f} | {_mb(sum(r['bytes']))} | "
                f"{sum(r['decode_s']) * 1e3:.1f} (+ {r['build_s'] * 1e3:.1f}) | {_mb(r['batch_bytes'])} "
                f"({_mb(r['routing_bytes'])}, {r['routing_dtype']}) |"
            )
    return "\n".join(lines)


def ratios(before: list[dict], after: list[dict]) -> str:
    """Before over after, same model, context and server kind, measured in the same run."""
    old = {(r["shape"], r["context"], r["path"]): r for r in before}
    out = []
    for r in after:
        base_path = "embedded, JSON" if r["path"].startswith("embedded") else r["path"]
        b = old.get((r["shape"], r["context"], base_path))
        if b is None or (r["path"] == "embedded, JSON" and "embedded, binary" in {x["path"] for x in after}):
            continue
        turn_bytes, turn_cpu = b["bytes"][-1] / r["bytes"][-1], b["decode_s"][-1] / r["decode_s"][-1]
        ep_bytes = sum(b["bytes"]) / sum(r["bytes"])
        ep_cpu = (sum(b["decode_s"]) + b["build_s"]) / (sum(r["decode_s"]) + r["build_s"])
        out.append(
            f"- {r['shape']}, {r['context']} tokens, {base_path} before -> {r['path']} after: last turn "
            f"{turn_bytes:.1f}x fewer bytes, {turn_cpu:.1f}x less decode CPU; episode {ep_bytes:.1f}x "
            f"fewer bytes, {ep_cpu:.1f}x less decode CPU (with the sample's build)"
        )
    return "\n".join(out)


def glm5_extrapolation(turns: int) -> str:
    layers, top_k, _ = SHAPES["glm5"]
    per_token = layers * top_k
    n = GLM5_TURN_TOKENS

    def b64(x: int) -> int:
        return 4 * -(-x // 3)

    added = n // turns
    return (
        f"GLM-5 ({layers} layers x top-{top_k} of 256 experts), one turn at {n} tokens of context, routing "
        f"bytes on the wire: int32 whole context in base64 {b64(n * per_token * 4) / 1e6:.0f} MB; uint8 "
        f"whole context in base64 (vLLM 0.32 asked without a start) {b64(n * per_token) / 1e6:.0f} MB; "
        f"uint8, only the turn's {added} new tokens (an episode of {turns} equal turns), base64 "
        f"{b64(added * per_token) / 1e6:.1f} MB (vLLM) or raw {added * per_token / 1e6:.1f} MB (binary "
        f"body); {per_token} bytes per new token."
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--shapes", nargs="+", default=["tiny-glm5-32k", "glm5"], choices=list(SHAPES))
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--completion", type=int, default=256, help="sampled tokens per turn")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--baseline-src", help="the src of the code before the change: the 'before' rows")
    p.add_argument("--baseline-label", default="the code before", help="what --baseline-src is (printed)")
    p.add_argument("--write", action="store_true", help="replace the section in BENCHMARKS.md")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return
    t0 = time.time()
    before_runs, after_runs = [], []
    for _ in range(args.repeats):  # before and after alternate, so both see the same machine load
        if args.baseline_src:
            before_runs.append(_child(args.baseline_src, args))
        after_runs.append(_child(str(Path(__file__).resolve().parents[1] / "src"), args))
    before = _medians(before_runs) if before_runs else []
    after = _medians(after_runs)
    load = os.getloadavg()[0]
    header = (
        f"One run ({args.repeats} alternating repeats, medians). Command: `PYTHONPATH=src python "
        "benchmarks/bench_r3_payload.py --baseline-src <src before> --write`; before: "
        f"{args.baseline_label}. Machine: {machine()}; "
        f"1-minute load average {load:.1f} at the end. Times are CPU time of the one thread that "
        "decodes (the orchestrator's process), from the body's bytes to the rows placed in the "
        f"trajectory; an episode is {args.turns} turns of {args.completion} sampled tokens each. The "
        "vLLM rows are answers the script builds in vLLM 0.32's format (an `.npy` in base64 from "
        "`routed_experts_prompt_start`), not a live vLLM: its CPU build cannot return routing. Ids are "
        "random; the batch stores them uint8 before and after (it already did)."
    )
    body = "\n\n".join(
        [
            header,
            table(before, after),
            ratios(before, after),
            glm5_extrapolation(args.turns),
            f"Took {time.time() - t0:.0f} s.",
        ]
    )
    print(body)
    if args.write:
        write_section(SECTION, f"{SECTION}\n\n{body}\n")


if __name__ == "__main__":
    main()
