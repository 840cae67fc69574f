"""`asyncrl slurm @ rl.toml [--dry-run]`: render (and submit) one sbatch job for a multi-node RL run.

The same TOML as `asyncrl rl`, plus a `[slurm]` table (asyncrl.config.SlurmConfig). The job
holds inference_nodes + trainer_nodes nodes; Slurm's node list is split in that order:

- inference: `servers_per_inference_node` servers per inference node, each on its own slice of
  the node's GPUs, listening on 0.0.0.0 at deployment.base_port + local index;
- trainer: one `torchrun` per trainer node (gpus_per_node processes each), joined by a c10d
  rendezvous on the first trainer node;
- orchestrator: on the first node of the group named by `orchestrator_on` (CPU only), given the
  servers' URLs, which are known only once Slurm has picked the hosts.

Per-process configs are resolved exactly as `asyncrl rl` resolves them and written to
RUN/configs/; the script goes to RUN/slurm.sbatch and logs to RUN/logs/. When the trainer exits,
the job stops the other processes and exits with the trainer's status. `--dry-run` writes the
configs and the script and submits nothing.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from pydantic import Field

from asyncrl.config import ConfigError, SlurmConfig, load_config
from asyncrl.config.base import config_help
from asyncrl.config.rl import RLConfig
from asyncrl.config.vllm import DEFAULT_VLLM_PYTHON
from asyncrl.launcher.parallel_check import check_trainer_parallel
from asyncrl.launcher.run_configs import write_configs
from asyncrl.launcher.vllm import build_vllm_command
from asyncrl.run_dir import config_file, log_file, logs_dir, sbatch_file

__all__ = ["SlurmRLConfig", "main", "render_sbatch"]


class SlurmRLConfig(RLConfig):
    """`asyncrl rl`'s config with the `[slurm]` table."""

    slurm: SlurmConfig = Field(default_factory=SlurmConfig)


def _check(cfg: SlurmRLConfig) -> None:
    s, d = cfg.slurm, cfg.deployment
    want = s.inference_nodes * s.servers_per_inference_node
    if d.num_inference_servers != want:
        raise ConfigError(
            f"deployment.num_inference_servers ({d.num_inference_servers}) must equal slurm.inference_nodes "
            f"* slurm.servers_per_inference_node = {s.inference_nodes} * {s.servers_per_inference_node} = "
            f"{want}"
        )
    if s.gpus_per_node % s.servers_per_inference_node:
        raise ConfigError(
            f"slurm.servers_per_inference_node ({s.servers_per_inference_node}) must divide "
            f"slurm.gpus_per_node ({s.gpus_per_node})"
        )


def _header(s: SlurmConfig, run_dir: Path) -> list[str]:
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={s.job_name}",
        f"#SBATCH --nodes={s.inference_nodes + s.trainer_nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={s.gpus_per_node}",
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


def _vllm_server(cfg: SlurmRLConfig) -> tuple[str, str]:
    """(extra `--export` entries, command) of one vLLM server; `$port` and `$i` are the loop's.

    vLLM runs from `[inference.vllm] python` (default .venv-vllm/bin/python, relative to the job's
    working directory); the API key reaches it as VLLM_API_KEY, read from the server's config.
    """
    inference = cfg.resolve().inference[0].model_copy(update={"host": "0.0.0.0"})
    python = inference.vllm.python or DEFAULT_VLLM_PYTHON
    command = build_vllm_command(inference, python=python)
    argv = [shlex.quote(a) for a in command.argv]
    argv[argv.index("--port") + 1] = '"$port"'
    argv[argv.index("--seed") + 1] = f'"$(({cfg.seed} + i))"'
    exports = "".join(f",{k}={shlex.quote(v)}" for k, v in sorted(command.env.items()) if k != "VLLM_API_KEY")
    return exports, " ".join(argv)


def _inference(cfg: SlurmRLConfig, py: str, run_dir: Path) -> list[str]:
    s, base_port = cfg.slurm, cfg.deployment.base_port
    per = s.servers_per_inference_node
    gpus = s.gpus_per_node // per
    lines = ["", "# inference servers", "SERVERS=()", "PIDS=()"]
    lines.append(f"for n in $(seq 0 {s.inference_nodes - 1}); do")
    lines.append(f"  for j in $(seq 0 {per - 1}); do")
    lines.append(f"    i=$((n * {per} + j)); port=$(({base_port} + j))")
    lines.append(f"    devices=$(seq -s, $((j * {gpus})) $((j * {gpus} + {gpus - 1})))")
    lines.append('    SERVERS+=("\\"http://${INFERENCE_NODES[$n]}:${port}\\"")')
    config, log = config_file(run_dir, "inference-${i}"), log_file(run_dir, "inference-${i}")
    exports, command = "", f'{py} inference @ "{config}" --host 0.0.0.0 --port "$port"'
    if cfg.inference.backend == "vllm":
        exports, command = _vllm_server(cfg)
        if cfg.api_key:
            key = f"tomllib.load(open('{config_file(run_dir, 'inference-0')}', 'rb'))['api_key']"
            lines.insert(2, f'export VLLM_API_KEY="$({cfg.slurm.python} -c "import tomllib; print({key})")"')
    lines.append(
        '    srun --nodes=1 --ntasks=1 --nodelist="${INFERENCE_NODES[$n]}" '
        f'--output="{log}" --export=ALL,CUDA_VISIBLE_DEVICES="$devices"{exports} \\'
    )
    lines.append(f"      {command} &")
    lines += ["    PIDS+=($!)", "  done", "done"]
    return lines


def render_sbatch(cfg: SlurmRLConfig, run_dir: Path) -> str:
    """The sbatch script text for `cfg` (configs are expected in RUN/configs/, as write_configs puts them)."""
    _check(cfg)
    s = cfg.slurm
    py = f"{s.python} -m asyncrl"
    orch_node = "${TRAINER_MASTER}" if s.orchestrator_on == "trainer" else "${INFERENCE_NODES[0]}"
    orch_config, orch_log = config_file(run_dir, "orchestrator"), log_file(run_dir, "orchestrator")
    lines = [*_header(s, run_dir), "", *_environment(s)]
    lines += _inference(cfg, py, run_dir)
    lines += [
        "",
        "# trainer: one torchrun per node, c10d rendezvous on the first trainer node",
        f"srun --nodes={s.trainer_nodes} --ntasks-per-node=1 "
        '--nodelist="$(IFS=,; echo "${TRAINER_NODES[*]}")" '
        f'--output="{log_file(run_dir, "trainer-%t")}" \\',
        f"  {s.python} -m torch.distributed.run --nnodes={s.trainer_nodes} "
        f"--nproc-per-node={s.gpus_per_node} "
        f'--rdzv-backend=c10d --rdzv-endpoint="${{TRAINER_MASTER}}:{s.rdzv_port}" '
        '--rdzv-id="$SLURM_JOB_ID" \\',
        f'  -m asyncrl trainer @ "{config_file(run_dir, "trainer")}" &',
        "TRAINER_PID=$!",
        "",
        "# orchestrator (CPU only): told the servers' URLs now that the hosts are known",
        f'srun --overlap --nodes=1 --ntasks=1 --nodelist="{orch_node}" --output="{orch_log}" \\',
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


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        print(config_help(SlurmConfig, "slurm"))
        print("\nAll other keys are those of `asyncrl rl --help`.")
        return 0
    dry_run = "--dry-run" in argv
    argv = [a for a in argv if a != "--dry-run"]
    try:
        # Servers listen on 0.0.0.0 on cluster nodes: they always get a per-run API key.
        cfg = load_config(SlurmRLConfig, argv).with_run_api_key(exposed=True)
        script = render_sbatch(cfg, Path(cfg.run_dir))
        s = cfg.slurm
        resolved = cfg.resolve(trainer_world_size=s.trainer_nodes * s.gpus_per_node)
        check_trainer_parallel(
            resolved.trainer,
            world_size=s.trainer_nodes * s.gpus_per_node,
            where=f"slurm.trainer_nodes * gpus_per_node = {s.trainer_nodes} * {s.gpus_per_node}",
        )
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
    if dry_run:
        return 0
    if shutil.which("sbatch") is None:
        print(
            "asyncrl slurm: sbatch not found on PATH (use --dry-run to only write the script)",
            file=sys.stderr,
        )
        return 2
    return subprocess.run(["sbatch", str(path)], check=False).returncode
