"""`asyncrl rl @ config.toml [--dotted.key value ...]`: asynchronous RL in one command.

Starts the inference server(s), the orchestrator and the trainer (through torchrun when
`deployment.trainer_nproc` > 1) as child processes, each logging to RUN/logs/<name>.log, with the
resolved config of every process written to RUN/configs/. On a terminal the console shows one
live status line (step, reward, mismatch KL, staleness, tok/s, batch fill) and the children's
warnings and errors; otherwise the orchestrator's and the trainer's progress lines are echoed
(asyncrl.launcher.console). The `[sinks]` table mirrors RUN/metrics.jsonl to W&B / TensorBoard.
Before any process starts, every input they will read is checked (asyncrl.launcher.preflight: the
model directory, each environment and its task files, the vLLM interpreter). When one process
fails, or on Ctrl-C, everything is stopped and the exit code is non-zero, naming the failing
process.

Top-level keys: model, run_dir, max_steps, seq_len, seed, and the tables [deployment],
[inference], [orchestrator], [trainer] (see docs/configuration.md). Any key can be overridden on
the command line: `--orchestrator.batch_size 32 --trainer.optim.lr 1e-4`.

Other flags:
  --resume      continue the run in run_dir after a crash or kill: the trainer from its newest
                checkpoint c, the orchestrator from the checkpoint stored with its newest batch,
                the servers from the newest published weights up to v_c (those after c are
                retracted and published again by the trainer; see asyncrl.launcher.resume)
  --dry-run     resolve and write the configs, print the commands, start nothing (and check no
                input: the files may live where the processes will run)
  --weights.transport distributed
                send each version to the servers over process groups instead of files
                (docs/weights-transfer.md): trainer rank 0 hosts the run's weights store on a free
                port of [deployment] host (or `[weights] endpoint`), handed to every process
  --slurm       render RUN/slurm.sbatch from the `[slurm]` table and submit it with sbatch
                (with --dry-run: only write it; with --resume: a job that resumes the run when it
                starts); same as `asyncrl slurm`, see asyncrl.launcher.slurm

The trainer's `[trainer.parallel]` table (FSDP2 / EP / CP degrees, docs/scaling.md) is passed
through to RUN/configs/trainer.toml; set `[deployment] trainer_nproc` (one node) or
`[slurm] trainer_nodes` x `gpus_per_node` (several nodes) to the world size it expects.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from asyncrl.config import ConfigError, load_config
from asyncrl.config.base import config_help
from asyncrl.config.inference import InferenceConfig
from asyncrl.config.orchestrator import OrchestratorConfig
from asyncrl.config.rl import _SHARED, ResolvedRL, RLConfig
from asyncrl.config.trainer import RLTrainerConfig
from asyncrl.launcher.console import Console, LiveConsole, PlainConsole
from asyncrl.launcher.parallel_check import check_trainer_parallel
from asyncrl.launcher.preflight import check_inputs
from asyncrl.launcher.resume import check_fresh_run_dir, plan_resume
from asyncrl.launcher.run_configs import write_configs
from asyncrl.launcher.slurm import SlurmRLConfig
from asyncrl.launcher.slurm import main as slurm_main
from asyncrl.launcher.slurm_inference import check_one_machine
from asyncrl.launcher.supervisor import ChildSpec, Supervisor
from asyncrl.launcher.vllm import VLLMCommand, build_vllm_command, check_vllm, probe_vllm, resolve_vllm_python
from asyncrl.orchestrator.evaluator import best_weights
from asyncrl.run_dir import log_file, logs_dir
from asyncrl.transport.sinks import build_sinks
from asyncrl.transport.weights import prune_weights, read_keep_set

__all__ = ["ThreadShares", "build_children", "main"]


def build_children(cfg: RLConfig, resolved: ResolvedRL, files: dict[str, Path]) -> list[ChildSpec]:
    py = [sys.executable, "-m", "asyncrl"]
    children = []
    for i in range(len(resolved.inference)):
        env = {}
        if cfg.deployment.inference_devices:
            env["CUDA_VISIBLE_DEVICES"] = cfg.deployment.inference_devices[i]
        argv = [*py, "inference", "@", str(files[f"inference-{i}"])]
        if resolved.inference[i].backend == "vllm":
            command = build_vllm_command(
                resolved.inference[i], python=resolve_vllm_python(resolved.inference[i])
            )
            argv, env = command.argv, env | command.env
        children.append(
            ChildSpec(
                name=f"inference-{i}",
                argv=argv,
                log=log_file(cfg.run_dir, f"inference-{i}"),
                env=env,
                max_restarts=cfg.deployment.max_inference_restarts,
            )
        )
    children.append(
        ChildSpec(
            name="orchestrator",
            argv=[*py, "orchestrator", "@", str(files["orchestrator"])],
            log=log_file(cfg.run_dir, "orchestrator"),
            echo_prefixes=("[orchestrator]",),
            may_exit_ok=True,
            done_ok=resolved.orchestrator.eval.enabled,  # it evaluates the final version after the trainer
        )
    )
    nproc = cfg.deployment.trainer_nproc
    if nproc > 1:
        trainer_cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "-m",
            "asyncrl",
            "trainer",
        ]
    else:
        trainer_cmd = [*py, "trainer"]
    env = {"CUDA_VISIBLE_DEVICES": cfg.deployment.trainer_devices} if cfg.deployment.trainer_devices else {}
    children.append(
        ChildSpec(
            name="trainer",
            argv=[*trainer_cmd, "@", str(files["trainer"])],
            log=log_file(cfg.run_dir, "trainer"),
            env=env,
            echo_prefixes=("step ",),
            done_ok=True,
        )
    )
    return children


@dataclass(frozen=True)
class ThreadShares:
    """OpenMP threads per child when OMP_NUM_THREADS is unset: the machine's cores split evenly among
    the processes that compute (each inference server, each trainer rank), one thread for the
    orchestrator. Left to itself each process starts one thread per core: on one machine that is
    more threads than cores, and OpenMP then puts its idle workers to sleep between ops, so every op
    of a small model pays a wake-up (docs/inference.md, "Torch threads"). A vLLM server counts
    among the computing processes but keeps its own thread binding."""

    cores: int
    num_compute: int
    threads: dict[str, int]  # child name -> OMP_NUM_THREADS

    @classmethod
    def plan(cls, resolved: ResolvedRL, trainer_nproc: int, cores: int) -> ThreadShares:
        num_compute = len(resolved.inference) + trainer_nproc
        share = max(1, cores // num_compute)
        embedded = [f"inference-{i}" for i, c in enumerate(resolved.inference) if c.backend != "vllm"]
        threads = dict.fromkeys(embedded, share) | {"trainer": share, "orchestrator": 1}
        return cls(cores=cores, num_compute=num_compute, threads=threads)

    def apply(self, children: list[ChildSpec]) -> None:
        for child in children:
            if child.name in self.threads:
                child.env["OMP_NUM_THREADS"] = str(self.threads[child.name])

    def describe(self) -> str:
        share = self.threads["trainer"]
        return (
            f"OMP_NUM_THREADS unset: {self.cores} core(s) for {self.num_compute} computing process(es) "
            f"(inference servers and trainer ranks): {share} torch thread(s) each, 1 for the "
            "orchestrator; set OMP_NUM_THREADS to choose one count for all"
        )


def free_port() -> int:
    """A TCP port free on every address a moment ago (the OS picks it): the weights store's, which
    trainer rank 0 binds on all addresses."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def build_console(cfg: RLConfig) -> Console:
    """A live status line on a terminal, plain echoed lines otherwise; both feed the sinks."""
    sinks = build_sinks(cfg.sinks, cfg.run_dir)
    if sys.stdout.isatty():
        return LiveConsole(cfg.run_dir, cfg.max_steps, sinks)
    return PlainConsole(cfg.run_dir, sinks)


def keys_help() -> str:
    """Every key of an `asyncrl rl` config, section by section, with its default and description."""
    sections = [config_help(RLConfig, exclude=("inference", "orchestrator", "trainer"))]
    for name, cls in (
        ("inference", InferenceConfig),
        ("orchestrator", OrchestratorConfig),
        ("trainer", RLTrainerConfig),
    ):
        shared = _SHARED[name]
        about = f"{cls.__name__}; {', '.join(shared)} come from the top level"
        if "max_model_len" in shared:
            about += " (max_model_len: the [inference] servers' context limit)"
        if "trainer_dp_size" in shared:
            about += " (trainer_dp_size: the [trainer] data-parallel ranks)"
        if "port" in shared:
            about += " (host, port: [deployment])"
        sections.append(config_help(RLConfig.model_fields[name].annotation, name, about=about))
    return "Keys (TOML, or `--dotted.key value` on the command line):\n\n" + "\n\n".join(sections)


def _shell(child: ChildSpec) -> str:
    """A child's command line with the variables the launcher adds to its environment (a vLLM server's
    PYTHONPATH to the worker extension, CUDA_VISIBLE_DEVICES, ...), to start it by hand; an API key in
    the environment is masked."""
    return VLLMCommand(argv=child.argv, env=child.env).shell()


def _check_vllm(resolved: ResolvedRL, *, skip_probe: bool) -> int:
    """Say what the vLLM backend cannot do here; probe the vLLM install (not on --dry-run)."""
    inference = resolved.inference[0]
    if not resolved.orchestrator.return_routed_experts:
        print(
            "asyncrl rl: router replay OFF: the vLLM servers do not return routed experts "
            "([inference.vllm] enable_return_routed_experts needs a GPU build); the trainer computes "
            "logprobs without replay, and the mismatch metrics show the cost"
        )
    if skip_probe:
        return 0
    python = resolve_vllm_python(inference)
    try:
        probe = probe_vllm(python, timeout_s=inference.vllm.startup_timeout_s)
        for cfg in resolved.inference:
            warnings = check_vllm(cfg, build_vllm_command(cfg, python=python), probe)
    except ConfigError as e:
        print(f"asyncrl rl: {e}", file=sys.stderr)
        return 2
    print(f"asyncrl rl: vLLM {probe.version} ({probe.device_type}) from {python}")
    for w in warnings:
        print(f"asyncrl rl: warning: {w}", file=sys.stderr)
    return 0


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        print(keys_help())
        return 0
    if "--slurm" in argv:
        return slurm_main([a for a in argv if a != "--slurm"])
    dry_run, resume = "--dry-run" in argv, "--resume" in argv
    argv = [a for a in argv if a not in ("--dry-run", "--resume")]
    try:
        # a [slurm] table is allowed and unused here; servers off loopback get a per-run API key
        cfg = load_config(SlurmRLConfig, argv).with_run_api_key(exposed=False)
        cfg = cfg.with_weights_endpoint(cfg.deployment.host, free_port())
        resolved = cfg.resolve()
        check_one_machine(resolved.inference[0])
        nproc = cfg.deployment.trainer_nproc
        check_trainer_parallel(
            resolved.trainer, world_size=nproc, where=f"deployment.trainer_nproc = {nproc}"
        )
        if not dry_run:
            check_inputs(resolved)
        if resume:
            plan = plan_resume(resolved, dry_run=dry_run)
            resolved = plan.resolved
            print(f"asyncrl rl: {plan.describe()}")
        else:
            check_fresh_run_dir(cfg.run_dir)
    except ConfigError as e:
        print(f"asyncrl rl: {e}", file=sys.stderr)
        return 2
    files = write_configs(cfg, resolved)
    children = build_children(cfg, resolved, files)
    print(
        f"asyncrl rl: run dir {cfg.run_dir}; configs in {files['rl'].parent}; logs in {logs_dir(cfg.run_dir)}"
    )
    if "OMP_NUM_THREADS" not in os.environ:
        shares = ThreadShares.plan(resolved, cfg.deployment.trainer_nproc, len(os.sched_getaffinity(0)))
        shares.apply(children)
        print(f"asyncrl rl: {shares.describe()}")
    for child in children:
        print(f"  {child.name}: {_shell(child)}")
    if resolved.inference[0].backend == "vllm":
        code = _check_vllm(resolved, skip_probe=dry_run)
        if code:
            return code
    if dry_run:
        return 0
    code = Supervisor(children, console=build_console(cfg)).run()
    print(
        f"asyncrl rl: {'finished' if code == 0 else 'FAILED'} (exit {code})",
        file=sys.stderr if code else sys.stdout,
    )
    if code == 0:
        _prune_finished(resolved)
        _print_best(resolved)
    return code


def _prune_finished(resolved: ResolvedRL) -> None:
    """Prune once more with the final keep-set: the trainer prunes as it publishes, so a version
    the keep-set held then (the best so far) but not at the end would otherwise stay."""
    run_dir = resolved.orchestrator.run_dir
    prune_weights(run_dir, resolved.trainer.publish.keep_last, keep=read_keep_set(run_dir))


def _print_best(resolved: ResolvedRL) -> None:
    """The path of the best version by `[orchestrator.eval] keep_best`, kept from pruning."""
    metric = resolved.orchestrator.eval.keep_best
    if not resolved.orchestrator.eval.enabled or metric is None:
        return
    best = best_weights(resolved.orchestrator.run_dir, resolved.orchestrator.model, metric)
    if best is None:
        print(f"asyncrl rl: no evaluated version has {metric} and weights on disk")
        return
    version, value, path = best
    print(f"asyncrl rl: best version by {metric}: v{version} ({value:.4f}), {path}")
