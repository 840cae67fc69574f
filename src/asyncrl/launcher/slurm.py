"""`asyncrl slurm @ rl.toml [--dry-run] [--resume]`: render (and submit) a multi-node RL run's sbatch job.

The same TOML as `asyncrl rl`, plus a `[slurm]` table (asyncrl.config.SlurmConfig). The job
holds inference_nodes + trainer_nodes nodes; Slurm's node list is split in that order:

- inference: the servers, each on its slice of a node's GPUs (CUDA_VISIBLE_DEVICES), or on that
  slice of several nodes for a vLLM data-parallel group that spans them (a head and headless
  followers), as asyncrl.launcher.slurm_inference places them; a node's j-th slice listens on
  0.0.0.0 at deployment.base_port + j, and its steps share the node through `srun --overlap`;
- trainer: one `torchrun` per trainer node (gpus_per_node processes each), joined by a c10d
  rendezvous on the first trainer node;
- orchestrator: on the first node of the group named by `orchestrator_on` (CPU only), given the
  servers' URLs (and their prefill servers' under `deployment = "disaggregated"`), which are known
  only once Slurm has picked the hosts.

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
from asyncrl.launcher.slurm_inference import ServerStep, inference_lines, plan_inference
from asyncrl.launcher.vllm import WORKER_EXTENSION_DIR
from asyncrl.run_dir import config_file, log_file, logs_dir, sbatch_file

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


def _plan(cfg: SlurmRLConfig) -> list[ServerStep]:
    _check_weights(cfg)
    return plan_inference(
        cfg.slurm,
        cfg.resolve().inference[0],
        num_servers=cfg.deployment.num_inference_servers,
        base_port=cfg.deployment.base_port,
        seed=cfg.seed,
    )


def _check_weights(cfg: SlurmRLConfig) -> None:
    if cfg.weights.transport == "distributed" and cfg.slurm.trainer_nodes > 1:
        raise ConfigError(
            f'[weights] transport = "distributed" with slurm.trainer_nodes = {cfg.slurm.trainer_nodes} is '
            "not supported yet: trainer rank 0, which hosts the weights store, lands on a node that "
            "torchrun's rendezvous picks when the job runs; use one trainer node, or "
            'transport = "filesystem"'
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


def _prefill(cfg: SlurmRLConfig) -> str:
    """The orchestrator's prefill servers, one per server, when each server is a prefill/decode pair."""
    if cfg.inference.deployment != "disaggregated":
        return ""
    return ' --prefill-servers "[$(IFS=,; echo "${PREFILL_SERVERS[*]}")]"'


def _vllm_paths(cfg: SlurmRLConfig) -> list[str]:
    """What a vLLM server reads from the submitting host's filesystem: its interpreter and our worker
    extension."""
    if cfg.inference.backend != "vllm":
        return []
    pythons = [v.python or DEFAULT_VLLM_PYTHON for v in (cfg.inference.vllm, cfg.inference.prefill) if v]
    return [*dict.fromkeys(pythons), str(WORKER_EXTENSION_DIR)]


def _inference(cfg: SlurmRLConfig, run_dir: Path) -> list[str]:
    inference = cfg.resolve().inference[0]
    return inference_lines(
        _plan(cfg),
        inference,
        slurm=cfg.slurm,
        run_dir=run_dir,
        api_key=bool(cfg.api_key),
        embedded_flags=_weights_flag(cfg),
    )


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
    _plan(cfg)  # the layout's errors before anything else
    s = cfg.slurm
    workdir = workdir or Path.cwd()
    py = f"{s.python} -m asyncrl"
    orch_node = "${TRAINER_MASTER}" if s.orchestrator_on == "trainer" else "${INFERENCE_NODES[0]}"
    orch_config, orch_log = config_file(run_dir, "orchestrator"), log_file(run_dir, "orchestrator")
    lines = [*_header(s, run_dir, workdir), "", *requirements_comment(s, run_dir, workdir), ""]
    lines += _environment(s)
    lines += cluster_check_lines(s, run_dir, [cfg.model, *_vllm_paths(cfg)])
    lines += _job_start(cfg, run_dir, resume=resume)
    lines += _inference(cfg, run_dir)
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
        f'  {py} orchestrator @ "{orch_config}" --servers "[$(IFS=,; echo "${{SERVERS[*]}}")]"'
        f"{_prefill(cfg)} &",
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
