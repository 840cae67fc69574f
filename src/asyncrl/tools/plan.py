"""`asyncrl plan`: per-GPU memory and step time of a trainer layout, and the whole RL step, before
renting the nodes.

    asyncrl plan --model CONFIG.json --nodes 28 --gpus-per-node 8 --seq-len 65536 \\
        --dp-shard -1 --ep 8 --cp 2
    asyncrl plan --model CONFIG.json --nodes 20 --seq-len 131072 --ep 8 --cp 8 \\
        --inference-nodes 8 --rollouts 256 --prompt-tokens 32768 --completion-tokens 16384 --serve-dtype fp8

The first prints the trainer's plan (`asyncrl.tools.plan_trainer`): per-GPU memory, all_to_all
volume, compute. It warns, and exits with status 1, when the layout does not fit in GPU memory.
With `--inference-nodes` it adds the RL step (`asyncrl.tools.plan_step`): the trainer's time
for the step's rollouts, the bytes and seconds of publishing one version, the rollouts' time on
the inference nodes, and the step time with what bounds it. `--config rl.toml` reads the layout
and RL-step keys of an `asyncrl rl` TOML (flags override). Bad values exit with status 2.

The model is a Hugging Face config.json of any family asyncrl.model runs (GQA or MLA, DSA, shared
experts), read for its shapes (`read_model_config`). docs/scaling.md explains every formula and
states every default with where it comes from.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pydantic import Field

from asyncrl.config import ConfigError, SlurmConfig, load_config
from asyncrl.config.rl import RLConfig
from asyncrl.distributed.dims import ParallelDimsError
from asyncrl.model.args import ModelArgs, ModelConfigError
from asyncrl.tools.plan_step import GPUS, RLInputs, RLStepError, build_step, format_step
from asyncrl.tools.plan_trainer import GB, Layout, MemoryPlan, build_plan, format_plan

__all__ = [
    "GB",
    "Layout",
    "MemoryPlan",
    "build_plan",
    "config_defaults",
    "format_plan",
    "load_model_config",
    "main",
    "read_model_config",
]


def load_model_config(path: str | Path) -> ModelArgs:
    """ModelArgs from a config.json file (or a directory holding one)."""
    return read_model_config(path)[0]


def read_model_config(path: str | Path) -> tuple[ModelArgs, list[str]]:
    """ModelArgs from a config.json for planning, and notes on what was read differently.

    The plan depends on shapes only: a checkpoint's `quantization_config` (FP8 weights, which
    loading dequantises) is named in the notes and planned as fp32 master weights.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"--model: {path} not found (give a Hugging Face config.json)")
    try:
        cfg = json.loads(path.read_text())
        cfg, notes = _shapes_only(cfg) if isinstance(cfg, dict) else (cfg, [])
        return ModelArgs.from_hf_config(cfg), notes
    except (json.JSONDecodeError, TypeError, ModelConfigError) as e:
        raise ModelConfigError(f"--model {path}: {e}") from None


def _shapes_only(cfg: dict) -> tuple[dict, list[str]]:
    cfg, notes = dict(cfg), []
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "?")
        notes.append(
            f"quantization_config ({method}) ignored: the plan assumes fp32 master weights and "
            "compute in --param-dtype"
        )
    return cfg, notes


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="asyncrl plan", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--config", help="an `asyncrl rl` TOML (with [slurm]): its layout and RL-step keys; flags override"
    )
    p.add_argument("--model", help="Hugging Face config.json (or its directory); default: the config's model")
    p.add_argument("--nodes", type=int, help="trainer nodes")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (trainer and inference)")
    p.add_argument("--seq-len", type=int, help="tokens per packed row")
    p.add_argument("--dp-replicate", type=int, default=1, help="HSDP replicas")
    p.add_argument("--dp-shard", type=int, default=-1, help="-1 = auto")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree")
    p.add_argument("--cp", type=int, default=1, help="context-parallel degree")
    p.add_argument("--micro-batches", type=int, default=1, help="packed rows per GPU per step")
    p.add_argument(
        "--no-activation-checkpointing", action="store_true", help="keep every block's activations"
    )
    p.add_argument(
        "--param-dtype", choices=["bf16", "fp32"], default="bf16", help="dtype of gathered weights"
    )
    p.add_argument("--prefetch", type=int, default=1, help="FSDP units gathered ahead of the one computing")
    p.add_argument("--gpu", choices=sorted(GPUS), default="h200", help="datasheet figures of the GPUs")
    p.add_argument("--gpu-mem-gb", type=float, default=None, help="default: the --gpu's")
    p.add_argument(
        "--reserve-gb", type=float, default=8.0, help="CUDA context, NCCL buffers, allocator fragmentation"
    )
    p.add_argument("--mfu", type=float, default=0.35, help="assumed model FLOPs utilisation for step time")
    p.add_argument(
        "--dsa-bf16",
        action="store_true",
        help="what-if: DSA's indexer and latent attention on bf16 tensor cores (the code runs them in fp32)",
    )
    p.add_argument("--a2a-gbps", type=float, default=50.0, help="per-GPU all_to_all GB/s across nodes")
    p.add_argument("--nvlink-gbps", type=float, default=400.0, help="per-GPU all_to_all GB/s within a node")
    _step_arguments(p.add_argument_group("RL step (with --inference-nodes)"))
    return p


def _step_arguments(g: argparse._ArgumentGroup) -> None:
    d = RLInputs(inference_nodes=1, rollouts=1, prompt_tokens=0, completion_tokens=1)
    g.add_argument("--inference-nodes", type=int, help="nodes serving rollouts; adds the RL step")
    g.add_argument(
        "--servers-per-node", type=int, default=d.servers_per_node, help="[slurm] servers_per_inference_node"
    )
    g.add_argument("--rollouts", type=int, help="samples per step ([orchestrator] batch_size)")
    g.add_argument("--prompt-tokens", type=int, help="mean tokens per rollout the servers prefill")
    g.add_argument("--completion-tokens", type=int, help="mean tokens per rollout the servers sample")
    g.add_argument(
        "--max-async-steps", type=int, default=d.max_async_steps, help="[orchestrator] max_async_steps"
    )
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="[inference] max_num_seqs")
    g.add_argument(
        "--serve-dtype",
        choices=["bf16", "fp32", "fp8"],
        default=d.serve_dtype,
        help="[inference] dtype; fp8: fp8.enabled",
    )
    g.add_argument(
        "--transfer",
        choices=["filesystem", "network"],
        default=d.transfer,
        help="how a version reaches the servers",
    )
    g.add_argument(
        "--fs-write-gbps", type=float, default=d.fs_write_gbps, help="shared filesystem, all writers"
    )
    g.add_argument(
        "--fs-read-gbps", type=float, default=d.fs_read_gbps, help="shared filesystem, all readers"
    )
    g.add_argument("--net-gbps", type=float, default=d.net_gbps, help="one inference node's NICs, GB/s")
    g.add_argument("--no-publish-overlap", action="store_true", help="[trainer.publish] overlap = false")
    g.add_argument(
        "--decode-tok-s", type=float, help="measured decode tokens/s of one server (default: roofline)"
    )
    g.add_argument(
        "--prefill-tok-s", type=float, help="measured prefill tokens/s of one server (default: roofline)"
    )


def _layout(ns: argparse.Namespace) -> Layout:
    gpu = GPUS[ns.gpu]
    return Layout(
        nodes=ns.nodes, gpus_per_node=ns.gpus_per_node, seq_len=ns.seq_len, dp_replicate=ns.dp_replicate,
        dp_shard=ns.dp_shard, ep=ns.ep, cp=ns.cp, micro_batches=ns.micro_batches,
        activation_checkpointing=not ns.no_activation_checkpointing, param_dtype=ns.param_dtype,
        prefetch=ns.prefetch, gpu_mem_gb=ns.gpu_mem_gb or gpu.mem_gb, reserve_gb=ns.reserve_gb,
        peak_tflops=gpu.bf16_tflops, fp32_tflops=gpu.fp32_tflops, mfu=ns.mfu, a2a_gbps=ns.a2a_gbps,
        nvlink_gbps=ns.nvlink_gbps, dsa_bf16=ns.dsa_bf16,
    )  # fmt: skip


def _rl_inputs(ns: argparse.Namespace) -> RLInputs | None:
    """The RL step's inputs, or None without --inference-nodes (then no RL flag may be given)."""
    needed = {
        "--rollouts": ns.rollouts,
        "--prompt-tokens": ns.prompt_tokens,
        "--completion-tokens": ns.completion_tokens,
    }
    if ns.inference_nodes is None:
        given = [flag for flag, value in needed.items() if value is not None]
        if given:
            raise RLStepError(f"{', '.join(given)} belong to the RL step: give --inference-nodes too")
        return None
    missing = [flag for flag, value in needed.items() if value is None]
    if missing:
        raise RLStepError(f"the RL step (--inference-nodes) needs {', '.join(missing)}")
    return RLInputs(
        inference_nodes=ns.inference_nodes, rollouts=ns.rollouts, prompt_tokens=ns.prompt_tokens,
        completion_tokens=ns.completion_tokens, servers_per_node=ns.servers_per_node,
        max_async_steps=ns.max_async_steps, max_num_seqs=ns.max_num_seqs, serve_dtype=ns.serve_dtype,
        gpu=ns.gpu, transfer=ns.transfer, fs_write_gbps=ns.fs_write_gbps, fs_read_gbps=ns.fs_read_gbps,
        net_gbps=ns.net_gbps, publish_overlap=not ns.no_publish_overlap, decode_tok_s=ns.decode_tok_s,
        prefill_tok_s=ns.prefill_tok_s,
    )  # fmt: skip


class _PlannedRL(RLConfig):
    """`asyncrl rl`'s config with its `[slurm]` table, as `asyncrl slurm` reads it."""

    slurm: SlurmConfig = Field(default_factory=SlurmConfig)


def config_defaults(path: str) -> dict[str, Any]:
    """The plan's flags (argparse dests) that an `asyncrl rl` TOML sets, validated as `asyncrl rl`
    validates it: the nodes and servers of `[slurm]`, `seq_len`, `[trainer.parallel]`, the batch
    and asynchrony of `[orchestrator]`, the servers' batch and dtype, and publishing's overlap."""
    cfg = load_config(_PlannedRL, ["@", path])
    s, par, inf = cfg.slurm, cfg.trainer.parallel, cfg.inference
    serve = "fp8" if inf.fp8.enabled else {"float32": "fp32", "bfloat16": "bf16"}[inf.dtype]
    model = Path(cfg.model) / "config.json"
    return {
        "model": str(model) if model.is_file() else None, "nodes": s.trainer_nodes,
        "inference_nodes": s.inference_nodes, "gpus_per_node": s.gpus_per_node,
        "servers_per_node": s.servers_per_inference_node, "seq_len": cfg.seq_len,
        "dp_replicate": par.dp_replicate, "dp_shard": par.dp_shard, "ep": par.ep, "cp": par.cp,
        "no_activation_checkpointing": not par.activation_checkpointing,
        "rollouts": cfg.orchestrator.batch_size, "max_async_steps": cfg.orchestrator.max_async_steps,
        "max_num_seqs": inf.max_num_seqs, "serve_dtype": serve,
        "no_publish_overlap": not cfg.trainer.publish.overlap,
    }  # fmt: skip


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """Flags over the --config's keys over the defaults; --model, --nodes and --seq-len are needed."""
    parser = _parser()
    first, _ = parser.parse_known_args(argv)
    if first.config:
        parser.set_defaults(**config_defaults(first.config))
    ns = parser.parse_args(argv)
    missing = [f"--{k.replace('_', '-')}" for k in ("model", "nodes", "seq_len") if getattr(ns, k) is None]
    if missing:
        parser.error(
            f"the following arguments are required: {', '.join(missing)} (or a --config that sets them)"
        )
    return ns


def main(argv: list[str] | None = None) -> int:
    try:
        ns = _parse(argv)
    except ConfigError as e:
        print(f"asyncrl plan: --config: {e}", file=sys.stderr)
        return 2
    layout = _layout(ns)
    try:
        inputs = _rl_inputs(ns)
        args, notes = read_model_config(ns.model)
        plan = build_plan(args, layout)
        step = build_step(args, layout, inputs) if inputs else None
    except (ParallelDimsError, ModelConfigError, RLStepError) as e:
        print(f"asyncrl plan: {e}", file=sys.stderr)
        return 2
    out = "".join(f"note: {n}\n" for n in notes) + format_plan(plan, layout)
    if step is not None and inputs is not None:
        out += "\n" + format_step(step, layout, inputs)
    print(out)
    return 0 if plan.fits else 1
