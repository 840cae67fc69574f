"""`asyncrl slurm @ rl.toml [--dry-run] [--resume]`: render (and submit) a multi-node RL run's sbatch job.

The same TOML as `asyncrl rl`, plus a `[slurm]` table (asyncrl.config.SlurmConfig). The job
holds inference_nodes + trainer_nodes nodes; Slurm's node list is split in that order:

- inference: `servers_per_inference_node` servers per inference node, listening on 0.0.0.0 at
  deployment.base_port + local index; they share the node through `srun --overlap`, each
  narrowed to its own slice of the node's GPUs (CUDA_VISIBLE_DEVICES);
- trainer: one `torchrun` per trainer node (gpus_per_node processes each), joined by a c10d
  rendezvous on the first trainer node;
- orchestrator: on the first node of the group named by `orchestrator_on` (CPU only), given the
  servers' URLs, which are known only once Slurm has picked the hosts.

With `[weights] transport = "distributed"` (one trainer node), trainer rank 0 hosts the weights
store on the trainer node at slurm.rdzv_port + 1 (unless `[weights] endpoint` names another
address): the configs hold the job's variable for that node, and the trainer and every server get
the address on their command line.

The job runs in the directory it was rendered from (`#SBATCH --chdir`), so every path of the
configs means on the nodes what it means here; it needs them on a filesystem shared by every node
at the same path and `gpus_per_node` GPUs per node, and checks both on every node before it starts
anything (asyncrl.launcher.slurm_checks). Then, on its head node, `asyncrl slurm --job-start`
checks the run's inputs where the processes will read them (asyncrl.launcher.preflight: a render
away from the cluster cannot), and that the run is new, or with `--resume` applies the resume plan
(asyncrl.launcher.resume) to what the run directory holds when the job starts, which may be hours
after it was rendered.

Per-process configs are resolved exactly as `asyncrl rl` resolves them and written to
RUN/configs/; the script goes to RUN/slurm.sbatch and logs to RUN/logs/ (appended to, so a resumed
job keeps the earlier ones). When the trainer exits, the job stops the other processes and exits
with the trainer's status. `--dry-run` writes the configs and the script and submits nothing.
`--model-config CONFIG.json` checks `[trainer.parallel]` against that model config where the model
directory is not readable (rendering away from the cluster's filesystem).
"""

from __future__ import annotations

import contextlib
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field

from asyncrl.config import ConfigError, SlurmConfig, load_config
from asyncrl.config.base import config_help
from asyncrl.config.rl import ResolvedRL, RLConfig
from asyncrl.config.vllm import DEFAULT_VLLM_PYTHON
from asyncrl.launcher.parallel_check import check_trainer_parallel
from asyncrl.launcher.preflight import check_inputs
from asyncrl.launcher.resume import check_fresh_run_dir, plan_resume
from asyncrl.launcher.run_configs import write_configs
from asyncrl.launcher.slurm_checks import cluster_check_lines, requirements_comment
from asyncrl.launcher.vllm import WORKER_EXTENSION_DIR, build_vllm_command
from asyncrl.run_dir import config_file, log_file, logs_dir, sbatch_file
from asyncrl.weight_transfer.control import ENV_ENDPOINT, ENV_SERVER

__all__ = ["SlurmRLConfig", "job_start", "main", "render_sbatch"]


class SlurmRLConfig(RLConfig):
    """`asyncrl rl`'s config with the `[slurm]` table."""

    slurm: SlurmConfig = Field(default_factory=SlurmConfig)

    def with_job_weights_endpoint(self) -> SlurmRLConfig:
        """With `[weights] transport = "distributed"` and no endpoint: trainer rank 0's node (known to
        the job only, so the configs hold the job's variable for it) at slurm.rdzv_port + 1."""
        return self.with_weights_endpoint(WEIGHTS_HOST, self.slurm.rdzv_port + 1)


# The job's variable for trainer rank 0's node, where the weights store listens. The configs hold it
# as text; the job passes the address, expanded, to the trainer and each server (`_weights_flag`).
WEIGHTS_HOST = "${TRAINER_MASTER}"


def _weights_flag(cfg: SlurmRLConfig) -> str:
    """` --weights.endpoint "HOST:PORT"` for the job's command lines when the run sends weights over
    process groups (the shell expands the host there), else nothing."""
    w = cfg.weights
    if w.transport != "distributed" or w.endpoint is None:
        return ""
    return f' --weights.endpoint "{w.endpoint}"'


def _check(cfg: SlurmRLConfig) -> None:
    s, d = cfg.slurm, cfg.deployment
    want = s.inference_nodes * s.servers_per_inference_node
    if d.num_inference_servers != want:
        raise ConfigError(
            f"deployment.num_inference_servers ({d.num_inference_servers}) must equal slurm.inference_nodes "
            f"* slurm.servers_per_inference_node = {s.inference_nodes} * {s.servers_per_inference_node} = "
            f"{want}"
        )
    if cfg.weights.transport == "distributed" and s.trainer_nodes > 1:
        raise ConfigError(
            f'[weights] transport = "distributed" with slurm.trainer_nodes = {s.trainer_nodes} is not '
            "supported yet: trainer rank 0, which hosts the weights store, lands on a node that torchrun's "
            'rendezvous picks when the job runs; use one trainer node, or transport = "filesystem"'
        )
    if s.gpus_per_node % s.servers_per_inference_node:
        raise ConfigError(
            f"slurm.servers_per_inference_node ({s.servers_per_inference_node}) must divide "
            f"slurm.gpus_per_node ({s.gpus_per_node})"
        )


def _header(s: SlurmConfig, run_dir: Path, workdir: Path) -> list[str]:
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={s.job_name}",
        f"#SBATCH --nodes={s.inference_nodes + s.trainer_nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={s.gpus_per_node}",
        f"#SBATCH --chdir={workdir}",
        # whole nodes (every CPU, all the memory): the steps of a node share them through --overlap
        "#SBATCH --exclusive",
        "#SBATCH --mem=0",
        f"#SBATCH --output={logs_dir(run_dir) / 'slurm-%j.out'}",
    ]
    lines += [
        f"#SBATCH --{k}={v}"
        for k, v in (("partition", s.partition), ("account", s.account), ("time", s.time))
        if v
    ]
    lines += [f"#SBATCH {opt}" for opt in s.extra_sbatch]
    return lines


def _environment(s: SlurmConfig) -> list[str]:
    lines = ["set -euo pipefail", *s.setup]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(s.env.items())]
    lines += [
        'NODES=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))',
        f'INFERENCE_NODES=("${{NODES[@]:0:{s.inference_nodes}}}")',
        f'TRAINER_NODES=("${{NODES[@]:{s.inference_nodes}:{s.trainer_nodes}}}")',
        'TRAINER_MASTER="${TRAINER_NODES[0]}"',
    ]
    return lines


def _vllm_server(cfg: SlurmRLConfig) -> str:
    """The command of one vLLM server, its environment set by `env`; `$port` and `$i` are the loop's.

    vLLM runs from `[inference.vllm] python` (default .venv-vllm/bin/python, relative to the job's
    working directory); the API key reaches it as VLLM_API_KEY, read from the server's config.
    """
    inference = cfg.resolve().inference[0].model_copy(update={"host": "0.0.0.0"})
    python = inference.vllm.python or DEFAULT_VLLM_PYTHON
    command = build_vllm_command(inference, python=python)
    argv = [shlex.quote(a) for a in command.argv]
    argv[argv.index("--port") + 1] = '"$port"'
    argv[argv.index("--seed") + 1] = f'"$(({cfg.seed} + i))"'
    job = {"VLLM_API_KEY", ENV_ENDPOINT, ENV_SERVER}  # set below or by the job, not verbatim
    env = [f"{k}={shlex.quote(v)}" for k, v in sorted(command.env.items()) if k not in job]
    if ENV_ENDPOINT in command.env:  # the store's host is the job's variable; server i is "server<i>"
        env += [f'{ENV_ENDPOINT}="{command.env[ENV_ENDPOINT]}"', f'{ENV_SERVER}="server${{i}}"']
    return " ".join(["env", *env, *argv])


def _vllm_paths(cfg: SlurmRLConfig) -> list[str]:
    """What a vLLM server reads from the submitting host's filesystem: its interpreter and our worker
    extension."""
    if cfg.inference.backend != "vllm":
        return []
    return [cfg.inference.vllm.python or DEFAULT_VLLM_PYTHON, str(WORKER_EXTENSION_DIR)]


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


def _inference(cfg: SlurmRLConfig, py: str, run_dir: Path) -> list[str]:
    s, base_port = cfg.slurm, cfg.deployment.base_port
    per = s.servers_per_inference_node
    gpus = s.gpus_per_node // per
    lines = ["", "# inference servers: on base_port + j, each on its slice of the node's GPUs", *_BIND_GPUS]
    lines += ["SERVERS=()", "PIDS=()"]
    config, log = config_file(run_dir, "inference-${i}"), log_file(run_dir, "inference-${i}")
    command = f'{py} inference @ "{config}" --host 0.0.0.0 --port "$port"{_weights_flag(cfg)}'
    if cfg.inference.backend == "vllm":
        command = _vllm_server(cfg)
        if cfg.api_key:
            key = f"tomllib.load(open('{config_file(run_dir, 'inference-0')}', 'rb'))['api_key']"
            lines.append(f'export VLLM_API_KEY="$({cfg.slurm.python} -c "import tomllib; print({key})")"')
    lines.append(f"for n in $(seq 0 {s.inference_nodes - 1}); do")
    lines.append(f"  for j in $(seq 0 {per - 1}); do")
    lines.append(f"    i=$((n * {per} + j)); port=$(({base_port} + j))")
    lines.append('    SERVERS+=("\\"http://${INFERENCE_NODES[$n]}:${port}\\"")')
    lines.append(
        '    srun --overlap --nodes=1 --ntasks=1 --nodelist="${INFERENCE_NODES[$n]}" '
        f"--gpus-per-node={s.gpus_per_node} \\"
    )
    lines.append(
        f'      --open-mode=append --output="{log}" --export=ALL,ASYNCRL_GPU_SLICE="$((j * '
        f'{gpus})):{gpus}" \\'
    )
    lines.append(f'      bash -c "$BIND_GPUS" bind-gpus {command} &')
    lines += ["    PIDS+=($!)", "  done", "done"]
    return lines


def _job_start(cfg: SlurmRLConfig, run_dir: Path, *, resume: bool) -> list[str]:
    """The head node's step before any process starts: `asyncrl slurm --job-start` (see `job_start`)."""
    flags = "--job-start --resume" if resume else "--job-start"
    what = "apply the resume plan to what the run directory holds now" if resume else "check the run is new"
    return [
        "",
        f"# on the head node, while no process of the run is alive: {what}",
        f'{cfg.slurm.python} -m asyncrl slurm {flags} @ "{config_file(run_dir, "rl")}"',
    ]


def render_sbatch(
    cfg: SlurmRLConfig, run_dir: Path, *, resume: bool = False, workdir: Path | None = None
) -> str:
    """The sbatch script text for `cfg` (configs are expected in RUN/configs/, as write_configs puts them).

    `workdir`: the job's working directory (default: the current one), against which every relative
    path of the configs resolves as it does here; `resume`: the job continues the run in `run_dir`.
    """
    _check(cfg)
    s = cfg.slurm
    workdir = workdir or Path.cwd()
    py = f"{s.python} -m asyncrl"
    orch_node = "${TRAINER_MASTER}" if s.orchestrator_on == "trainer" else "${INFERENCE_NODES[0]}"
    orch_config, orch_log = config_file(run_dir, "orchestrator"), log_file(run_dir, "orchestrator")
    lines = [*_header(s, run_dir, workdir), "", *requirements_comment(s, run_dir, workdir), ""]
    lines += _environment(s)
    lines += cluster_check_lines(s, run_dir, [cfg.model, *_vllm_paths(cfg)])
    lines += _job_start(cfg, run_dir, resume=resume)
    lines += _inference(cfg, py, run_dir)
    lines += [
        "",
        "# trainer: one torchrun per node, c10d rendezvous on the first trainer node",
        f'srun --nodes={s.trainer_nodes} --ntasks-per-node=1 --nodelist="$(IFS=,; echo '
        '"${TRAINER_NODES[*]}")" '
        f'--open-mode=append --output="{log_file(run_dir, "trainer-%t")}" \\',
        f"  {s.python} -m torch.distributed.run --nnodes={s.trainer_nodes} "
        f"--nproc-per-node={s.gpus_per_node} "
        f'--rdzv-backend=c10d --rdzv-endpoint="${{TRAINER_MASTER}}:{s.rdzv_port}" '
        '--rdzv-id="$SLURM_JOB_ID" \\',
        f'  -m asyncrl trainer @ "{config_file(run_dir, "trainer")}"{_weights_flag(cfg)} &',
        "TRAINER_PID=$!",
        "",
        "# orchestrator (CPU only): told the servers' URLs now that the hosts are known",
        f'srun --overlap --nodes=1 --ntasks=1 --nodelist="{orch_node}" --open-mode=append '
        f'--output="{orch_log}" \\',
        f'  {py} orchestrator @ "{orch_config}" --servers "[$(IFS=,; echo "${{SERVERS[*]}}")]" &',
        "PIDS+=($!)",
        "",
        "# the run ends with the trainer; stop everything else and report the trainer's status",
        "status=0",
        'wait "$TRAINER_PID" || status=$?',
        'kill "${PIDS[@]}" 2>/dev/null || true',
        "wait || true",
        'exit "$status"',
    ]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True, kw_only=True)
class _Flags:
    dry_run: bool = False
    resume: bool = False
    job_start: bool = False
    model_config: Path | None = None


def _flags(argv: list[str]) -> tuple[_Flags, list[str]]:
    """This command's own flags, and the config arguments left."""
    found: dict[str, object] = {}
    rest = []
    args = iter(argv)
    for arg in args:
        if arg in ("--dry-run", "--resume", "--job-start"):
            found[arg[2:].replace("-", "_")] = True
        elif arg == "--model-config" or arg.startswith("--model-config="):
            value = arg.partition("=")[2] or next(args, "")
            if not value:
                raise ConfigError("--model-config needs a path: the model's config.json")
            found["model_config"] = Path(value)
        else:
            rest.append(arg)
    return _Flags(**found), rest  # type: ignore[arg-type]


@contextlib.contextmanager
def _model_dir_for_checks(model_config: Path | None) -> Iterator[Path | None]:
    """A directory holding `model_config` as its config.json (None without one), for the launcher's checks."""
    if model_config is None:
        yield None
        return
    if not model_config.is_file():
        raise ConfigError(f"--model-config {model_config}: no such file (give the model's config.json)")
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copyfile(model_config, Path(tmp) / "config.json")
        yield Path(tmp)


def _resolve(cfg: SlurmRLConfig, model_config: Path | None) -> ResolvedRL:
    """Every process's config, the trainer's layout checked against its nodes' GPUs (and the model's
    expert count, read from `model_config` when given, else from the model directory if it is here)."""
    s = cfg.slurm
    world_size = s.trainer_nodes * s.gpus_per_node
    resolved = cfg.resolve(trainer_world_size=world_size)
    with _model_dir_for_checks(model_config) as model_dir:
        check_trainer_parallel(
            resolved.trainer,
            world_size=world_size,
            where=f"slurm.trainer_nodes * gpus_per_node = {s.trainer_nodes} * {s.gpus_per_node}",
            model_dir=model_dir,
        )
    if model_config is None and not (Path(cfg.model) / "config.json").is_file():
        print(
            f"asyncrl slurm: note: {cfg.model}/config.json is not readable here: the job checks the model "
            "on every node when it starts, and the trainer checks [trainer.parallel] against its expert "
            "count (--model-config CONFIG.json checks that now)"
        )
    return resolved


def job_start(argv: list[str], *, resume: bool) -> int:
    """What the rendered job runs on its head node before any process of the run (`--job-start`).

    First every input the processes read (asyncrl.launcher.preflight), here where they will read
    them. Then, for a new run: check that the run directory holds none. `--resume`: plan the resume
    from what the run directory holds now (asyncrl.launcher.resume), apply it, and rewrite
    RUN/configs/ with it. `argv` names RUN/configs/rl.toml, the config the job was rendered from.
    """
    try:
        cfg = load_config(SlurmRLConfig, argv)
        s = cfg.slurm
        resolved = cfg.resolve(trainer_world_size=s.trainer_nodes * s.gpus_per_node)
        check_inputs(resolved)
        if not resume:
            check_fresh_run_dir(cfg.run_dir)
            return 0
        plan = plan_resume(resolved)
    except ConfigError as e:
        print(f"asyncrl slurm: {e}", file=sys.stderr)
        return 2
    write_configs(cfg, plan.resolved)
    print(f"asyncrl slurm: {plan.describe()}")
    return 0


def _submit(path: Path) -> int:
    if shutil.which("sbatch") is None:
        print(
            "asyncrl slurm: sbatch not found on PATH (use --dry-run to only write the script)",
            file=sys.stderr,
        )
        return 2
    return subprocess.run(["sbatch", str(path)], check=False).returncode


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        print(config_help(SlurmConfig, "slurm"))
        print("\nAll other keys are those of `asyncrl rl --help`.")
        return 0
    try:
        flags, argv = _flags(argv)
        if flags.job_start:
            return job_start(argv, resume=flags.resume)
        # Servers listen on 0.0.0.0 on cluster nodes: they always get a per-run API key.
        cfg = load_config(SlurmRLConfig, argv).with_run_api_key(exposed=True).with_job_weights_endpoint()
        script = render_sbatch(cfg, Path(cfg.run_dir), resume=flags.resume)
        resolved = _resolve(cfg, flags.model_config)
        if flags.resume:
            plan = plan_resume(resolved, dry_run=True)  # the job plans again when it starts
            resolved = plan.resolved
            print(
                f"asyncrl slurm: the job resumes the run; from what {cfg.run_dir} holds now: "
                f"{plan.describe()}"
            )
        else:
            check_fresh_run_dir(cfg.run_dir)
    except ConfigError as e:
        print(f"asyncrl slurm: {e}", file=sys.stderr)
        return 2
    run_dir = Path(cfg.run_dir)
    logs_dir(run_dir).mkdir(parents=True, exist_ok=True)
    write_configs(cfg, resolved)
    path = sbatch_file(run_dir)
    path.write_text(script)
    print(
        f"asyncrl slurm: wrote {path} ({cfg.slurm.inference_nodes} inference + {cfg.slurm.trainer_nodes} "
        "trainer nodes)"
    )
    return 0 if flags.dry_run else _submit(path)
