"""The inference side of an `asyncrl rl --slurm` job: which server runs where, on which GPUs and ports.

A server is what the orchestrator sends requests to. With vLLM it is a data-parallel group: its
head serves HTTP and balances over the group's engines, `data_parallel_size_local` per node on
`data_parallel_size / data_parallel_size_local` nodes; the other nodes run headless followers
that hand their engines to the head. With `[inference] deployment = "disaggregated"` each server
is a pair of groups, a prefill one and a decode one (asyncrl.client.disaggregated joins them).

Placement (`plan_inference`). Every inference node is cut into `servers_per_inference_node`
slices of `gpus_per_node / servers_per_inference_node` GPUs. Groups take slices in order, prefill
groups before decode ones: each takes the first free slice (node by node, then slice by slice)
and the same slice on the next nodes it spans. A group uses its slice's first
`tensor x pipeline x data_parallel_size_local` GPUs (CUDA_VISIBLE_DEVICES, set per step). The
j-th slice of a node listens on `base_port + j`, and a group headed there hands its engines over
on `data_parallel_rpc_port + j`. The groups must fill every slice: a slice left idle is a config
mistake, and so is a group that does not fit.

    plan = plan_inference(slurm, inference, num_servers=2, base_port=8000)
    lines = inference_lines(plan, ...)    # the job's shell lines that start them
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from asyncrl.config import ConfigError, InferenceConfig, SlurmConfig
from asyncrl.config.inference import Role
from asyncrl.config.vllm import DEFAULT_VLLM_PYTHON
from asyncrl.launcher.vllm import build_vllm_command, data_parallel_group_argv
from asyncrl.run_dir import config_file, log_file
from asyncrl.weight_transfer.endpoint import ENV_ENDPOINT

__all__ = ["ServerStep", "check_one_machine", "inference_lines", "plan_inference"]


@dataclass(frozen=True, kw_only=True)
class ServerStep:
    """One `srun` step of the inference side: one node of one server.

    Example: the follower of a decode group of 2 nodes, on GPUs 2..3 of inference node 1:
    ServerStep(role="decode", server=0, node=1, gpu_first=2, gpu_count=2, head=0, port=8001,
    rpc_port=13346, start_rank=1, seed=1)
    """

    role: Role
    server: int  # index among the servers of its role (the orchestrator's order)
    node: int  # index into the job's inference nodes
    gpu_first: int
    gpu_count: int
    head: int  # the inference node of the group's head (its URL's host)
    port: int  # the head's HTTP port
    rpc_port: int  # the head's data-parallel handshake port
    start_rank: int  # first data-parallel rank on this node; 0 on the head
    seed: int

    @property
    def name(self) -> str:
        """Its log's name: inference-i (prefill-i, decode-i), with the first rank of a follower."""
        base = f"inference-{self.server}" if self.role == "serve" else f"{self.role}-{self.server}"
        return base if self.start_rank == 0 else f"{base}-rank{self.start_rank}"


def check_one_machine(inference: InferenceConfig) -> None:
    """ConfigError for what only a Slurm job lays out: prefill/decode pairs and groups over nodes
    (`asyncrl rl` without --slurm starts one server per port on this machine)."""
    if inference.deployment == "disaggregated":
        raise ConfigError(
            '[inference] deployment = "disaggregated" runs under `asyncrl rl --slurm` only (it places the '
            "prefill and decode servers and hands the orchestrator their pairs)"
        )
    v = inference.vllm
    if inference.backend == "vllm" and v.nodes_per_group > 1:
        raise ConfigError(
            f"[inference.vllm] data_parallel_size_local ({v.data_parallel_size_local}) < data_parallel_size "
            f"({v.data_parallel_size}) spreads a server over nodes: run it with `asyncrl rl --slurm`"
        )


def _roles(inference: InferenceConfig) -> list[Role]:
    return ["serve"] if inference.deployment == "colocated" else ["prefill", "decode"]


def _group_shape(inference: InferenceConfig, role: Role, slice_gpus: int) -> tuple[int, int]:
    """(nodes, GPUs per node) of one server in `role`; an embedded server takes its whole slice."""
    if inference.backend != "vllm":
        return 1, slice_gpus
    v = inference.role_config(role).vllm
    if v.gpus_per_node > slice_gpus:
        key = "[inference.prefill]" if role == "prefill" and inference.prefill else "[inference.vllm]"
        raise ConfigError(
            f"{key}: a {role} server runs data_parallel_size_local x tensor_parallel_size x "
            f"pipeline_parallel_size = {v.engines_per_node} x {v.tensor_parallel_size} x "
            f"{v.pipeline_parallel_size} = {v.gpus_per_node} GPUs per node, more than its slice of "
            f"slurm.gpus_per_node / servers_per_inference_node = {slice_gpus}"
        )
    return v.nodes_per_group, v.gpus_per_node


def _check_slices(slurm: SlurmConfig) -> int:
    if slurm.gpus_per_node % slurm.servers_per_inference_node:
        raise ConfigError(
            f"slurm.servers_per_inference_node ({slurm.servers_per_inference_node}) must divide "
            f"slurm.gpus_per_node ({slurm.gpus_per_node})"
        )
    return slurm.gpus_per_node // slurm.servers_per_inference_node


def _slots_message(slurm: SlurmConfig, inference: InferenceConfig, num_servers: int, need: int) -> str:
    have = slurm.inference_nodes * slurm.servers_per_inference_node
    what = f"deployment.num_inference_servers ({num_servers})"
    if inference.deployment == "disaggregated":
        what += " prefill/decode pairs"
    if need != num_servers:
        what += f" take {need} node slices (data-parallel groups spanning nodes, prefill and decode)"
    return (
        f"{what} must equal slurm.inference_nodes * slurm.servers_per_inference_node = "
        f"{slurm.inference_nodes} * {slurm.servers_per_inference_node} = {have}"
    )


def plan_inference(
    slurm: SlurmConfig, inference: InferenceConfig, *, num_servers: int, base_port: int, seed: int = 0
) -> list[ServerStep]:
    """Every step of the inference side (see the module docstring); ConfigError when they do not fit.

    Seeds: server i of the first role gets seed + i, of the second seed + num_servers + i.
    """
    slice_gpus = _check_slices(slurm)
    groups = [(r, i) for r in _roles(inference) for i in range(num_servers)]
    shapes = [_group_shape(inference, role, slice_gpus) for role, _ in groups]
    need = sum(nodes for nodes, _ in shapes)
    if need != slurm.inference_nodes * slurm.servers_per_inference_node:
        raise ConfigError(_slots_message(slurm, inference, num_servers, need))
    free = [(n, j) for n in range(slurm.inference_nodes) for j in range(slurm.servers_per_inference_node)]
    steps = []
    for k, ((role, i), (nodes, gpus)) in enumerate(zip(groups, shapes, strict=True)):
        head, j = next(
            ((n, j) for n, j in free if all((n + m, j) in free for m in range(nodes))),
            (None, None),
        )
        if head is None or j is None:
            raise ConfigError(
                f"the {role} server {i} spans {nodes} nodes and finds no free slice on {nodes} consecutive "
                "inference nodes (groups take the nodes' slices in order, never wrapping around): use a "
                "number of inference nodes that every group's span divides"
            )
        v = inference.role_config(role).vllm
        for m in range(nodes):
            free.remove((head + m, j))
            steps.append(
                ServerStep(
                    role=role,
                    server=i,
                    node=head + m,
                    gpu_first=j * slice_gpus,
                    gpu_count=gpus,
                    head=head,
                    port=base_port + j,
                    rpc_port=v.data_parallel_rpc_port + j,
                    start_rank=m * v.engines_per_node,
                    seed=seed + k,
                )
            )
    return steps


# Runs "$@" on one server's slice of its node's GPUs (ASYNCRL_GPU_SLICE = first:count): a slice of the
# ones Slurm gives the step (all of the node's, shared by its servers through --overlap), or of
# 0, 1, ... where Slurm sets none.
_BIND_GPUS = [
    "read -r -d '' BIND_GPUS <<'BIND' || true",
    "first=${ASYNCRL_GPU_SLICE%:*}; count=${ASYNCRL_GPU_SLICE#*:}",
    'IFS=, read -r -a gpus <<< "${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((first + count - 1)))}"',
    'if [ "${#gpus[@]}" -lt $((first + count)) ]; then',
    "  echo \"asyncrl slurm: a server needs GPUs $first..$((first + count - 1)) of the step's, "
    'which has ${CUDA_VISIBLE_DEVICES}" >&2; exit 1',
    "fi",
    'export CUDA_VISIBLE_DEVICES="$(IFS=,; echo "${gpus[*]:first:count}")"',
    'exec "$@"',
    "BIND",
]


def _launch(gpus_per_node: int) -> list[str]:
    return [
        "launch() {  # inference node index, GPU slice (first:count), log file, command...",
        '  local node="${INFERENCE_NODES[$1]}" slice=$2 log=$3; shift 3',
        f'  srun --overlap --nodes=1 --ntasks=1 --nodelist="$node" --gpus-per-node={gpus_per_node} \\',
        '    --open-mode=append --output="$log" --export=ALL,ASYNCRL_GPU_SLICE="$slice" \\',
        '    bash -c "$BIND_GPUS" bind-gpus "$@" &',
        "  PIDS+=($!)",
        "}",
    ]


def _vllm_command(resolved: InferenceConfig, step: ServerStep) -> str:
    """The vLLM command of `step`, its environment set by `env`; the API key comes from the job's
    environment (VLLM_API_KEY, exported once), never from the command line.

    vLLM runs from `[inference.vllm] python` (default .venv-vllm/bin/python, relative to the job's
    working directory).
    """
    cfg = resolved.role_config(step.role)
    update: dict[str, object] = {"host": "0.0.0.0", "port": step.port, "seed": step.seed}
    if cfg.weights.transport == "distributed":  # its own name on the run's weights store
        update["weights_server"] = f"{'prefill' if step.role == 'prefill' else 'server'}{step.server}"
    cfg = cfg.model_copy(update=update)
    command = build_vllm_command(cfg, python=cfg.vllm.python or DEFAULT_VLLM_PYTHON)
    argv = [shlex.quote(a) for a in command.argv]
    if cfg.vllm.nodes_per_group > 1:
        address = f'"${{INFERENCE_NODES[{step.head}]}}"'
        argv = data_parallel_group_argv(
            argv, cfg, address=address, rpc_port=str(step.rpc_port), start_rank=step.start_rank
        )
    env = [
        f"{k}={shlex.quote(v)}"
        for k, v in sorted(command.env.items())
        if k not in ("VLLM_API_KEY", ENV_ENDPOINT)
    ]
    if ENV_ENDPOINT in command.env:  # the store's host is the job's variable: the job's shell expands it
        env.append(f'{ENV_ENDPOINT}="{command.env[ENV_ENDPOINT]}"')
    return " ".join(["env", *env, *argv])


def _url(step: ServerStep) -> str:
    return f'"\\"http://${{INFERENCE_NODES[{step.head}]}}:{step.port}\\""'


def inference_lines(
    steps: list[ServerStep],
    resolved: InferenceConfig,
    *,
    slurm: SlurmConfig,
    run_dir: Path,
    api_key: bool,
    embedded_flags: str = "",
) -> list[str]:
    """The job's lines that start every step of `steps` in the background (their PIDs in PIDS) and
    collect the servers' URLs: SERVERS (serving or decode) and PREFILL_SERVERS, in server order.
    `embedded_flags` end each embedded server's command line (the weights endpoint)."""
    lines = ["", "# inference servers: one step per node of each, on its slice of the node's GPUs"]
    lines += [*_BIND_GPUS, *_launch(slurm.gpus_per_node), "SERVERS=()", "PREFILL_SERVERS=()", "PIDS=()"]
    if resolved.backend == "vllm" and api_key:
        key = f"tomllib.load(open('{config_file(run_dir, 'inference-0')}', 'rb'))['api_key']"
        lines.append(f'export VLLM_API_KEY="$({slurm.python} -c "import tomllib; print({key})")"')
    for step in steps:
        if step.start_rank == 0:
            urls = "PREFILL_SERVERS" if step.role == "prefill" else "SERVERS"
            lines.append(f"{urls}+=({_url(step)})")
        if resolved.backend == "vllm":
            command = _vllm_command(resolved, step)
        else:
            config = config_file(run_dir, f"inference-{step.server}")
            command = f'{slurm.python} -m asyncrl inference @ "{config}" --host 0.0.0.0 --port {step.port}'
            command += embedded_flags
        slice_ = f"{step.gpu_first}:{step.gpu_count}"
        lines.append(f'launch {step.node} {slice_} "{log_file(run_dir, step.name)}" {command}')
    return lines
