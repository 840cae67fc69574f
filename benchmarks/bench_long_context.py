"""Long context on a GLM-5-shaped model: DSA sparse against the dense masked reference, MLA decode
on the latent against the expanded one; engine prefill and decode, trainer step time and memory.

    PYTHONPATH=src python benchmarks/bench_long_context.py [--lengths 4096 16384 32768] [--topk 512]
        [--decode-tokens 8] [--prefill-chunk 2048] [--dense-prefill-max 16384] [--mem-cap-gb 8]
        [--threads N] [--skip-engine] [--skip-trainer] [--write]

The model is tiny-glm5 widened so that attention matters (`bench_args`: hidden 256, 2 layers, 8
heads, latent 128 + rope 32, an indexer of 4 heads x 32 in every layer, `--topk` selected keys),
fp32, random weights. Attention paths are `asyncrl.inference.kv_cache.AttentionPaths` in the
engine and `PackedCausalAttention(sparse=...)` in the trainer: "sparse" attends over each query's
selected keys, "dense" over all keys with the selection as a [T, S] mask (how DSA first ran
here); "latent" decodes on the cached latent with kv_b_proj absorbed, "expanded" rebuilds
per-head K/V of the context at every step.

Engine: one request per context length. Its prompt is prefilled once by a sparse engine and
once by a dense one (chunks of `--prefill-chunk` tokens); the sparse engine's request then
decodes `--decode-tokens` timed tokens under each of the four decode paths in turn (the paths
are switched between steps of the same request, after one untimed step each).

Trainer: one row of L tokens, forward and backward of the LM head's log-sum-exp, one timed step
in a child process per (length, path), so that the peak RSS growth over the step is its own.
A child runs under an address-space cap (`--mem-cap-gb`): a dense step that does not fit stops
at its first failed allocation instead of exhausting a shared machine ("not run"), and the table
gives a lower bound of what it needs: the room it had, or the fp32 attention probabilities
[heads, T, T] it keeps for backward, whichever is larger.

Times are "wall (cpu)": wall seconds, then process CPU seconds (all threads summed); decode rates
are tokens per wall second (per CPU second). On a shared, loaded machine run it with --threads 1:
waiting intra-op threads spin, which inflates both figures by an amount that depends on the load.

It prints one table per part; `--write` also replaces its section of BENCHMARKS.md. No
assertions: the ratios are read in the table, measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time

import torch

from asyncrl.config.inference import InferenceConfig
from asyncrl.inference import Engine, SamplingOptions
from asyncrl.inference.kv_cache import AttentionPaths
from asyncrl.model import ModelArgs, Transformer, preset_args
from asyncrl.model.layers import PackedCausalAttention
from report import machine, write_section

TITLE = "## Long context: sparse DSA and latent MLA decode (GLM-5-shaped)"
DECODE_PATHS = {
    "sparse, latent": AttentionPaths(),
    "sparse, expanded": AttentionPaths(latent_decode=False),
    "dense, latent": AttentionPaths(sparse=False),
    "dense, expanded": AttentionPaths(sparse=False, latent_decode=False),
}


def bench_args(topk: int, max_len: int) -> ModelArgs:
    return dataclasses.replace(
        preset_args("tiny-glm5"),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=32,
        q_lora_rank=128,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        moe_intermediate_size=128,
        index_n_heads=4,
        index_head_dim=32,
        index_topk=topk,
        indexer_types=("full", "full"),
        max_position_embeddings=max_len,
    )


def build_model(topk: int, max_len: int) -> Transformer:
    model = Transformer(bench_args(topk, max_len))
    model.init_weights(seed=0, std=0.05)
    return model


# -- engine --------------------------------------------------------------------------------------
def _engine(model: Transformer, length: int, extra: int, chunk: int, paths: AttentionPaths) -> Engine:
    tokens = length + extra
    config = InferenceConfig(
        model="unused",
        block_size=16,
        kv_cache_tokens=tokens,
        max_model_len=tokens,
        max_num_batched_tokens=chunk,
        max_num_seqs=1,
        enable_prefix_caching=False,
    )
    return Engine(model, config, attention_paths=paths)


class _Clock:
    """Wall and process CPU seconds (all threads summed) since construction."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def read(self, per: int = 1) -> tuple[float, float]:
        return (time.perf_counter() - self.wall) / per, (time.process_time() - self.cpu) / per


def _prefill(engine: Engine, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    """(wall, cpu) seconds from admission to the first sampled token."""
    engine.add_request("r", prompt, SamplingOptions(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    clock = _Clock()
    while not any(out.new_token_ids for out in engine.step()):
        pass
    return clock.read()


def _decode(engine: Engine, steps: int) -> tuple[float, float]:
    """(wall, cpu) seconds per decode step (one token), after an untimed step."""
    engine.step()
    clock = _Clock()
    for _ in range(steps):
        engine.step()
    return clock.read(steps)


def _warm_up(model: Transformer, chunk: int) -> None:
    """Every path once on a short request, so first-call costs stay out of the timings."""
    length = 2 * model.args.index_topk
    prompt = torch.randint(0, 256, (length,)).tolist()
    for paths in DECODE_PATHS.values():
        engine = _engine(model, length, 4, chunk, paths)
        _prefill(engine, prompt, 3)
        _decode(engine, 1)


def engine_rows(
    model: Transformer, lengths: list[int], decode_tokens: int, chunk: int, dense_prefill_max: int
) -> list[dict]:
    _warm_up(model, chunk)
    rows = []
    for length in lengths:
        prompt = torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(length)).tolist()
        extra = 2 + len(DECODE_PATHS) * (decode_tokens + 1)
        sparse = _engine(model, length, extra, chunk, AttentionPaths())
        row = {"length": length, "prefill sparse": _prefill(sparse, prompt, extra - 1), "prefill dense": None}
        for name, paths in DECODE_PATHS.items():
            sparse.attention_paths = paths
            row[f"decode {name}"] = _decode(sparse, decode_tokens)
        sparse.abort_all()
        if length <= dense_prefill_max:
            dense = _engine(model, length, 2, chunk, DECODE_PATHS["dense, expanded"])
            row["prefill dense"] = _prefill(dense, prompt, 1)
            dense.abort_all()
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def _pair(seconds: tuple[float, float] | None, invert: bool = False) -> str:
    """'wall (cpu)' of a timing, as seconds or (invert) as a rate per second."""
    if seconds is None:
        return "not run"
    wall, cpu = (1 / x for x in seconds) if invert else seconds
    return f"{wall:.1f} ({cpu:.1f})"


def engine_table(rows: list[dict]) -> str:
    names = list(DECODE_PATHS)
    lines = [
        "| context | prefill sparse (s) | prefill dense (s) | "
        + " | ".join(f"decode {n} (tok/s)" for n in names)
        + " | decode speed-up, sparse latent over dense expanded |",
        "|---" * (4 + len(names)) + "|",
    ]
    for r in rows:
        decode = [r[f"decode {n}"] for n in names]
        cells = [
            _pair(r["prefill sparse"]),
            _pair(r["prefill dense"]),
            *(_pair(x, invert=True) for x in decode),
        ]
        speedup = _pair(tuple(d / s for d, s in zip(decode[-1], decode[0], strict=True)))
        lines.append(f"| {r['length']} | " + " | ".join(cells) + f" | {speedup}x |")
    return "\n".join(lines)


def decode_summary(rows: list[dict]) -> str:
    """Sparse latent decode's CPU time per token at each length, relative to the first."""
    cpu = [r["decode sparse, latent"][1] for r in rows]
    steps = ", ".join(f"{r['length']}: {c / cpu[0]:.2f}" for r, c in zip(rows, cpu, strict=True))
    return (
        f"Sparse latent decode, CPU time per token relative to {rows[0]['length']} tokens: {steps} "
        "(attention reads index_topk rows whatever the context; the indexer still scores every cached key)."
    )


# -- trainer -------------------------------------------------------------------------------------
def _statm_bytes(field: int) -> int:
    """/proc/self/statm: field 0 is the address space in use, 1 the resident set."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[field]) * os.sysconf("SC_PAGE_SIZE")


def trainer_step(topk: int, length: int, sparse: bool) -> dict:
    """One forward + backward at `length` tokens: (wall, cpu) seconds and peak RSS growth (bytes);
    or, when the address-space cap stops it, the room it had ("headroom_bytes")."""
    model = build_model(topk, length)
    warm = torch.randint(0, 256, (1, 64))
    model(warm).logits.logsumexp(-1).mean().backward()  # first-call costs out of the timing
    model.zero_grad(set_to_none=False)
    ids = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(length))
    positions = torch.arange(length)[None]
    before, headroom = _statm_bytes(1), resource.getrlimit(resource.RLIMIT_AS)[0] - _statm_bytes(0)
    clock = _Clock()
    try:
        out = model(ids, positions, attention=PackedCausalAttention(positions, sparse=sparse))
        out.logits.logsumexp(-1).mean().backward()
    except (RuntimeError, MemoryError) as e:  # torch reports a failed allocation as RuntimeError
        if isinstance(e, RuntimeError) and "allocate" not in str(e):
            raise
        return {"headroom_bytes": headroom}
    seconds = clock.read()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": seconds, "peak_bytes": max(0, peak - before)}


def _run_child(topk: int, length: int, sparse: bool, cap_gb: float) -> dict | None:
    """trainer_step in a fresh process under an address-space cap; None when it failed."""
    cap = int(cap_gb * 2**30)

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    cmd = [
        sys.executable,
        __file__,
        "--trainer-child",
        str(length),
        str(int(sparse)),
        "--topk",
        str(topk),
        "--threads",
        str(torch.get_num_threads()),
    ]
    done = subprocess.run(cmd, preexec_fn=limit, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"trainer {length} {'sparse' if sparse else 'dense'}: failed ({done.stderr.strip()[-200:]})")
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def trainer_rows(topk: int, lengths: list[int], cap_gb: float) -> list[dict]:
    rows = []
    for length in lengths:
        row = {"length": length}
        for sparse in (True, False):
            row["sparse" if sparse else "dense"] = _run_child(topk, length, sparse, cap_gb)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def _dense_floor(length: int) -> int:
    """Bytes a dense step cannot do without: SDPA's math path (the only one that takes the mask
    with MLA's unequal key and value widths) keeps the fp32 probabilities [heads, T, T] for backward."""
    return bench_args(1, 1).num_attention_heads * length**2 * 4


def trainer_table(rows: list[dict]) -> str:
    lines = [
        "| context | step sparse (s) | step dense (s) | peak sparse (GiB) | peak dense (GiB) | dense "
        "/ sparse peak |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        s, d = r["sparse"], r["dense"]
        cells = ["failed" if run is None else _pair(run.get("seconds")) for run in (s, d)]
        need = (
            None
            if d is None
            else d.get("peak_bytes", max(d.get("headroom_bytes", 0), _dense_floor(r["length"])))
        )
        for run, peak in ((s, None if s is None else s.get("peak_bytes")), (d, need)):
            if run is None or peak is None:
                cells.append("failed")
            else:
                cells.append(
                    f"{peak / 2**30:.2f}" if "peak_bytes" in run else f"> {peak / 2**30:.1f} (not run)"
                )
        ratio = "-"
        if s is not None and need is not None and "peak_bytes" in s:
            ratio = ("" if "peak_bytes" in d else "> ") + f"{need / max(s['peak_bytes'], 1):.1f}x"
        lines.append(f"| {r['length']} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--topk", type=int, default=512, help="DSA index_topk")
    p.add_argument("--decode-tokens", type=int, default=8, help="timed decode steps per path")
    p.add_argument("--prefill-chunk", type=int, default=2048, help="engine max_num_batched_tokens")
    p.add_argument("--dense-prefill-max", type=int, default=16384, help="longest dense engine prefill")
    p.add_argument("--mem-cap-gb", type=float, default=8.0, help="address-space cap of a trainer step")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--skip-trainer", action="store_true")
    p.add_argument("--write", action="store_true", help="replace this section of BENCHMARKS.md")
    p.add_argument("--trainer-child", type=int, nargs=2, metavar=("LENGTH", "SPARSE"), help=argparse.SUPPRESS)
    a = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(a.threads)
    if a.trainer_child:
        print(json.dumps(trainer_step(a.topk, a.trainer_child[0], bool(a.trainer_child[1]))))
        return
    load_at_start, started = os.getloadavg()[0], time.perf_counter()
    parts = []
    if not a.skip_engine:
        model = build_model(a.topk, max(a.lengths) + 64).eval()
        rows = engine_rows(model, a.lengths, a.decode_tokens, a.prefill_chunk, a.dense_prefill_max)
        parts += [
            f"Engine, one sequence: its prompt prefilled in chunks of {a.prefill_chunk} tokens by a sparse "
            f"and (up to {a.dense_prefill_max} tokens) a dense engine, then {a.decode_tokens} timed decode "
            "tokens per path, the paths switched between steps of the same request. Speed-up: time per "
            "token of dense expanded (how the engine decoded before) over sparse latent.",
            engine_table(rows),
            decode_summary(rows),
        ]
    if not a.skip_trainer:
        rows = trainer_rows(a.topk, a.lengths, a.mem_cap_gb)
        parts += [
            "Trainer, one row, forward + backward (peak = RSS growth over the step; a dense step that "
            f'does not fit under the {a.mem_cap_gb:g} GiB address-space cap is "not run", with a lower '
            "bound of what it needs: the room it had, or its fp32 attention probabilities kept for "
            "backward, whichever is larger):",
            trainer_table(rows),
        ]
    args = bench_args(a.topk, 0)
    header = (
        "One run. Command: `PYTHONPATH=src python benchmarks/bench_long_context.py "
        f"{' '.join(sys.argv[1:])}` "
        f"({(time.perf_counter() - started) / 60:.0f} min).\n"
        f"Machine: {machine()}; torch {torch.__version__}, {torch.get_num_threads()} torch thread(s); "
        f"1-minute load average {load_at_start:.1f} at start, {os.getloadavg()[0]:.1f} at end.\n"
        f"Model: tiny-glm5 widened, fp32, random weights: hidden {args.hidden_size}, "
        f"{args.num_hidden_layers} layers, {args.num_attention_heads} heads, latent "
        f"{args.kv_lora_rank} + rope "
        f"{args.qk_rope_head_dim}, indexer {args.index_n_heads} heads x {args.index_head_dim} in "
        "every layer, "
        f'index_topk {a.topk} ({args.num_params() / 1e6:.1f}M parameters). Cells are "wall (cpu)" seconds, '
        f"or tokens per wall (cpu) second; on a shared machine the CPU figures, and ratios of them, are "
        f"the ones to read."
    )
    body = "\n\n".join([header, *parts])
    print("\n" + body)
    if a.write:
        write_section(TITLE, f"{TITLE}\n\n{body}\n")


if __name__ == "__main__":
    main()
