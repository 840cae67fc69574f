"""The rendered Slurm job of a tiny GLM-5 run on this machine through a stand-in Slurm: train, kill, resume.

    PYTHONPATH=src python benchmarks/bench_slurm_resume.py [--preset tiny-glm5] [--no-write]

No cluster is at hand, so the job `asyncrl rl --slurm` renders runs through tests/fake_slurm.py:
sbatch, srun, scontrol and scancel stand-ins that start each step as a local process with its
node's Slurm variables. Two fake nodes (loopback addresses): 127.0.0.2 holds the 2 inference
servers (one `srun --overlap` step each, on base_port and base_port + 1), 127.0.0.3 the trainer's
torchrun (4 ranks, gloo, FSDP x EP 2) and the orchestrator. The run has 5 steps. Job 1 runs until
the trainer has finished 3 of them and is cancelled (every process of the job killed, as scancel
does); `asyncrl rl --slurm --resume` renders job 2, which finishes the run. The run directory is
then audited as the fault suite audits it (tests/integration/faults/audit.py): every batch trained
once, none skipped, no rollout group lost; the script fails if not.

Its phases' seconds go to BENCHMARKS.md under "## Slurm: kill and resume through a stand-in srun".
The whole takes 3 to 3.5 minutes on 2 busy cores, mostly the start-up of 7 processes per job, too
long for the test suite; tests/unit/launcher/test_slurm_job.py checks the same job's mechanics
(placement, GPU slices, ports, the cluster check, the head node's input check) in under a minute.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tomli_w

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the stand-in Slurm and the run audit are the test suite's

from asyncrl.tools.init_model import init_model  # noqa: E402
from asyncrl.transport.metrics import read_metrics  # noqa: E402
from fake_slurm import FakeSlurm  # noqa: E402
from helpers import child_env, free_port, free_port_run  # noqa: E402
from integration.faults.audit import audit_run  # noqa: E402
from report import write_section  # noqa: E402

TITLE = "## Slurm: kill and resume through a stand-in srun"
NODES = ["127.0.0.2", "127.0.0.3"]
KILL_AFTER, MAX_STEPS = 3, 5
JOB_TIMEOUT_S = 600


def build_config() -> dict:
    """The run: tiny batches of 4-token reverse-text answers, a checkpoint every step."""
    return {
        "model": "model",
        "run_dir": "run",
        "max_steps": MAX_STEPS,
        "seq_len": 256,
        "deployment": {"num_inference_servers": 2, "base_port": free_port_run(2)},
        "inference": {"max_num_seqs": 32},
        "orchestrator": {
            "batch_size": 8,
            "group_size": 4,
            "max_async_steps": 1,
            "max_off_policy_steps": 1,
            "health_poll_s": 0.5,
            "sampling": {"temperature": 1.0, "max_tokens": 4},
            "envs": {
                "envs": [
                    {
                        "name": "reverse-text",
                        "args": {"min_len": 1, "max_len": 1, "alphabet": "abcdefgh"},
                        "max_total_tokens": 256,
                    }
                ]
            },
        },
        "trainer": {
            "optim": {"lr": 2e-3},
            "peak_flops": 1e11,
            "checkpoint": {"interval": 1},
            "parallel": {"ep": 2},
        },
        "slurm": {
            "inference_nodes": 1,
            "trainer_nodes": 1,
            "gpus_per_node": 4,  # the trainer's torchrun starts one rank per GPU; each server takes 2
            "servers_per_inference_node": 2,
            "rdzv_port": free_port(),
            "python": sys.executable,
        },
    }


def submit(cwd: Path, env: dict[str, str], *flags: str) -> None:
    argv = [sys.executable, "-m", "asyncrl", "rl", "@", "rl.toml", "--slurm", *flags]
    out = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    if out.returncode != 0 or "Submitted batch job" not in out.stdout:
        raise SystemExit(f"asyncrl rl --slurm {' '.join(flags)} failed:\n{out.stdout}{out.stderr}")


def trainer_steps(run: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run, "trainer")] if (run / "metrics.jsonl").is_file() else []


def wait_for_steps(cluster: FakeSlurm, job: int, run: Path, n: int) -> float:
    """Seconds until the trainer has finished `n` steps in all (the job still running)."""
    start = time.monotonic()
    while len(trainer_steps(run)) < n:
        if cluster.returncode(job) is not None:
            raise SystemExit(f"job {job} ended early:\n{logs(run)}")
        if time.monotonic() - start > JOB_TIMEOUT_S:
            raise SystemExit(f"job {job}: {len(trainer_steps(run))} of {n} steps in {JOB_TIMEOUT_S} s")
        time.sleep(0.2)
    return time.monotonic() - start


def logs(run: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted((run / "logs").iterdir()))


def run_jobs(workdir: Path, preset: str) -> tuple[list[tuple[str, float]], str]:
    """Both jobs on one fresh run: the phases with their seconds, and job 2's resume plan."""
    init_model(preset, workdir / "model", seed=0)
    (workdir / "rl.toml").write_text(tomli_w.dumps(build_config()))
    cluster = FakeSlurm(workdir / "slurm", NODES)
    env = cluster.env(child_env())
    run = workdir / "run"
    t0 = time.monotonic()
    submit(workdir, env)
    first = wait_for_steps(cluster, 1, run, 1)
    rest = wait_for_steps(cluster, 1, run, KILL_AFTER)
    cluster.cancel(1)
    cluster.wait(1, timeout_s=60)
    killed_at = len(trainer_steps(run))
    t1 = time.monotonic()
    submit(workdir, env, "--resume")
    resumed_first = wait_for_steps(cluster, 2, run, killed_at + 1)
    code = cluster.wait(2, timeout_s=JOB_TIMEOUT_S)
    if code != 0:
        raise SystemExit(f"job 2 exited {code}:\n{logs(run)}")
    end = time.monotonic()
    audit_run(run, MAX_STEPS).check()
    out = (run / "logs" / "slurm-2.out").read_text()
    plan = next(line for line in out.splitlines() if "resuming:" in line).removeprefix("asyncrl slurm: ")
    phases = [
        ("job 1: submitted to its first trained step", first),
        (f"job 1: steps 2..{killed_at}, then scancel", rest),
        (f"job 2 (`--resume`): submitted to its first trained step ({killed_at + 1})", resumed_first),
        (f"job 2: on to step {MAX_STEPS}, and the job's end", end - t1 - resumed_first),
        ("both jobs, submit to end (audit passed)", end - t0),
    ]
    return phases, plan


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny-glm5")
    p.add_argument("--no-write", action="store_true")
    ns = p.parse_args(argv)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        phases, plan = run_jobs(Path(tmp), ns.preset)
    load_after = os.getloadavg()[0]
    table = "| phase | seconds |\n|---|---|\n" + "\n".join(f"| {name} | {s:.1f} |" for name, s in phases)
    print(table)
    print(f"job 2's head node: {plan}")
    if not ns.no_write:
        header = (
            f"The rendered sbatch of a {ns.preset} run (2 inference servers on one fake node, 4 "
            "trainer ranks "
            "under torchrun with gloo on another, the orchestrator beside them) through tests/fake_slurm.py: "
            f"{KILL_AFTER} steps, scancel, `asyncrl rl --slurm --resume`, {MAX_STEPS} steps in all.\n"
            f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, shared (1-minute load average "
            f"{load_before:.1f} before, {load_after:.1f} after); torch CPU.\n"
            f"Command: `PYTHONPATH=src python benchmarks/bench_slurm_resume.py --preset {ns.preset}`\n\n"
        )
        note = (
            f"\nJob 2's head node, before any process started: {plan}. The run directory then passed the "
            f"fault suite's audit: batches 1..{MAX_STEPS} each trained once, no rollout group lost.\n"
            "Each job's first step waits for the cluster check, the head node's input check and resume "
            "plan, and the start-up of 2 servers, 4 trainer ranks and the orchestrator on the same 2 cores.\n"
        )
        write_section(TITLE, f"{TITLE}\n\n{header}{table}\n{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
