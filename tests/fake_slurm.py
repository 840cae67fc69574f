"""A stand-in for Slurm on one machine, to run the sbatch jobs `asyncrl slurm` renders.

    cluster = FakeSlurm(tmp_path / "slurm", nodes=["127.0.0.2", "127.0.0.3"])
    env = cluster.env(child_env())            # sbatch, srun, scontrol, scancel first on PATH
    subprocess.run(["sbatch", script], env=env)   # prints "Submitted batch job 1"
    assert cluster.wait(1, timeout_s=60) == 0     # or cluster.cancel(1)

Nodes are names that reach this machine: loopback addresses (127.0.0.2, 127.0.0.3, ...), so a
server that binds 0.0.0.0 on "node" 127.0.0.2 answers there as it would on a cluster. All nodes
share one port space: a test gives every server on them its own port.

- `sbatch SCRIPT` reads the script's `#SBATCH` --nodes, --chdir, --output and --gpus-per-node,
  takes the first --nodes nodes, and runs `bash SCRIPT` in its own session with the job's Slurm
  variables (SLURM_JOB_ID, SLURM_JOB_NODELIST, ...). It returns at once; the job's exit status
  goes to STATE/job-N.rc.
- `srun [options] COMMAND...` starts one local process per task, with the task's variables
  (SLURM_PROCID, SLURM_NODEID, SLURM_LOCALID, SLURMD_NODENAME, ...), `--export`, `--output` (%t,
  %n, %N, %j) and `--open-mode`, waits for them and exits with the highest status. SIGTERM and
  SIGINT go on to the tasks. Options it does not know are errors, and so is an --export entry
  that is neither NAME=value nor a variable name (a value with a comma), so that a mistake in a
  rendered job fails here as it would on a cluster.
- `scontrol show hostnames LIST` prints LIST (comma-separated names) one name a line.
- `scancel N` kills every process of job N, as Slurm's cgroup does: those whose environment
  carries the job's tag, so torchrun's workers (which leave the process group) go too.

Per-node differences: `node_env` is set in every task on a node (the GPUs Slurm would set in
CUDA_VISIBLE_DEVICES), and `node_cwd` is a node's working directory in place of the submitting
one (a node whose filesystem at the job's path holds something else).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["FakeSlurm"]

_TAG = "FAKE_SLURM_JOB_TAG"
_STATE = "FAKE_SLURM_STATE"
_COMMANDS = ("sbatch", "srun", "scontrol", "scancel")


class FakeSlurm:
    """One fake cluster: its state directory, its nodes, and the commands on PATH that use them."""

    def __init__(
        self,
        state: Path,
        nodes: list[str],
        *,
        node_env: dict[str, dict[str, str]] | None = None,
        node_cwd: dict[str, str] | None = None,
    ) -> None:
        self.state, self.bin = state, state / "bin"
        self.bin.mkdir(parents=True, exist_ok=True)
        config = {"nodes": nodes, "node_env": node_env or {}, "node_cwd": node_cwd or {}}
        (state / "cluster.json").write_text(json.dumps(config))
        for name in _COMMANDS:
            shim = self.bin / name
            shim.write_text(f'#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} {name} "$@"\n')
            shim.chmod(0o755)

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """`base` with this cluster's commands first on PATH."""
        return base | {"PATH": f"{self.bin}{os.pathsep}{base.get('PATH', '')}", _STATE: str(self.state)}

    def returncode(self, job: int) -> int | None:
        rc = self.state / f"job-{job}.rc"
        return int(rc.read_text()) if rc.is_file() and rc.read_text().strip() else None

    def wait(self, job: int, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while (code := self.returncode(job)) is None:
            assert time.monotonic() < deadline, f"fake Slurm job {job} still running after {timeout_s} s"
            time.sleep(0.2)
        return code

    def processes(self, job: int) -> list[int]:
        """PIDs of the processes of `job` that are alive."""
        return _tagged(_job_tag(self.state, job))

    def cancel(self, job: int) -> None:
        _cancel(self.state, job)


def _job_tag(state: Path, job: int) -> str:
    return f"{state}:{job}"


def _tagged(tag: str) -> list[int]:
    needle = f"{_TAG}={tag}\0".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if needle in (proc / "environ").read_bytes():
                pids.append(int(proc.name))
        except OSError:  # gone, or not ours
            continue
    return pids


def _cancel(state: Path, job: int) -> None:
    tag = _job_tag(state, job)
    for _ in range(50):  # a process may fork while the others are being killed
        pids = _tagged(tag)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    raise AssertionError(f"processes of fake Slurm job {job} survive SIGKILL: {_tagged(tag)}")


def _cluster() -> tuple[Path, dict]:
    state = Path(os.environ[_STATE])
    return state, json.loads((state / "cluster.json").read_text())


# ---- sbatch ---------------------------------------------------------------------------------


def _sbatch_options(script: Path) -> dict[str, str]:
    options = {}
    for line in script.read_text().splitlines():
        if m := re.match(r"#SBATCH --([\w-]+)(?:=(.*))?$", line.strip()):
            options[m[1]] = m[2] or ""
    return options


def _sbatch(argv: list[str]) -> int:
    script = Path(argv[-1]).resolve()
    state, cluster = _cluster()
    options = _sbatch_options(script)
    num_nodes = int(options.get("nodes", "1"))
    if num_nodes > len(cluster["nodes"]):
        print(
            f"sbatch: error: {num_nodes} nodes asked, the fake cluster has {len(cluster['nodes'])}",
            file=sys.stderr,
        )
        return 1
    counter = state / "last-job"
    job = int(counter.read_text()) + 1 if counter.is_file() else 1
    counter.write_text(str(job))
    nodes = cluster["nodes"][:num_nodes]
    workdir = options.get("chdir", os.getcwd())
    output = Path(workdir, options.get("output", "slurm-%j.out").replace("%j", str(job)))
    env = os.environ | {
        "SLURM_JOB_ID": str(job),
        "SLURM_JOBID": str(job),
        "SLURM_JOB_NODELIST": ",".join(nodes),
        "SLURM_JOB_NUM_NODES": str(num_nodes),
        "SLURM_NNODES": str(num_nodes),
        "SLURM_SUBMIT_DIR": os.getcwd(),
        "SLURMD_NODENAME": nodes[0],
        _TAG: _job_tag(state, job),
    }
    if "gpus-per-node" in options:
        env["SLURM_GPUS_PER_NODE"] = options["gpus-per-node"]
    output.parent.mkdir(parents=True, exist_ok=True)
    with output.open("a") as out:
        runner = [
            sys.executable,
            str(Path(__file__).resolve()),
            "_job",
            str(state / f"job-{job}.rc"),
            str(script),
        ]
        # the runner carries no tag: it outlives a scancel to record the job's status
        env_runner = {k: v for k, v in env.items() if k != _TAG} | {"FAKE_SLURM_JOB_ENV": json.dumps(env)}
        subprocess.Popen(
            runner,
            cwd=workdir,
            env=env_runner,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    print(f"Submitted batch job {job}")
    return 0


def _job(argv: list[str]) -> int:
    rc_file, script = Path(argv[0]), argv[1]
    env = json.loads(os.environ["FAKE_SLURM_JOB_ENV"])
    code = subprocess.run(["bash", script], env=env, check=False).returncode
    rc_file.write_text(str(128 - code if code < 0 else code))
    return 0


# ---- srun -----------------------------------------------------------------------------------


def _srun_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="srun", allow_abbrev=False)
    p.add_argument("-N", "--nodes", type=int)
    p.add_argument("-n", "--ntasks", type=int)
    p.add_argument("--ntasks-per-node", type=int)
    p.add_argument("-w", "--nodelist")
    p.add_argument("-o", "--output")
    p.add_argument("--open-mode", choices=("append", "truncate"), default="truncate")
    p.add_argument("--export")
    p.add_argument("--overlap", action="store_true")
    p.add_argument("--exact", action="store_true")
    p.add_argument("--gpus-per-node")
    p.add_argument("--cpus-per-task", type=int)
    p.add_argument("command", nargs=argparse.REMAINDER)
    return p


def _step_env(export: str | None) -> dict[str, str]:
    items = (export or "ALL").split(",")
    env = dict(os.environ) if items[0] == "ALL" else {}
    for item in items[1:] if items[0] in ("ALL", "NONE") else items:
        name, eq, value = item.partition("=")
        if not eq and not re.fullmatch(r"[A-Za-z_]\w*", name):
            raise SystemExit(
                f"srun: error: --export entry {item!r} is neither NAME=value nor a variable name"
            )
        env[name] = value if eq else os.environ.get(name, "")
    return env


def _step_nodes(args: argparse.Namespace, job_nodes: list[str]) -> list[str]:
    nodes = args.nodelist.split(",") if args.nodelist else job_nodes[: args.nodes or len(job_nodes)]
    unknown = [n for n in nodes if n not in job_nodes]
    if unknown or (args.nodes and len(nodes) != args.nodes):
        raise SystemExit(
            f"srun: error: nodes {nodes} (--nodes {args.nodes}) do not fit the job's {job_nodes}"
        )
    return nodes


def _tasks_per_node(args: argparse.Namespace, num_nodes: int) -> int:
    if args.ntasks_per_node:
        return args.ntasks_per_node
    if args.ntasks:
        if args.ntasks % num_nodes:
            raise SystemExit(f"srun: error: --ntasks {args.ntasks} is not a multiple of {num_nodes} nodes")
        return args.ntasks // num_nodes
    return 1


def _srun(argv: list[str]) -> int:
    _, cluster = _cluster()
    args = _srun_parser().parse_args(argv)
    if not args.command:
        raise SystemExit("srun: error: no command")
    job_nodes = os.environ["SLURM_JOB_NODELIST"].split(",")
    nodes = _step_nodes(args, job_nodes)
    per_node = _tasks_per_node(args, len(nodes))
    base = _step_env(args.export)
    step = {
        "SLURM_STEP_NODELIST": ",".join(nodes),
        "SLURM_STEP_NUM_NODES": str(len(nodes)),
        "SLURM_STEP_NUM_TASKS": str(per_node * len(nodes)),
        "SLURM_NTASKS": str(per_node * len(nodes)),
        "SLURM_NNODES": str(len(nodes)),
    }
    files: dict[str, object] = {}
    tasks = []
    for n, node in enumerate(nodes):
        for local in range(per_node):
            rank = n * per_node + local
            env = base | step | cluster["node_env"].get(node, {})
            env |= {
                "SLURM_PROCID": str(rank),
                "SLURM_LOCALID": str(local),
                "SLURMD_NODENAME": node,
                "SLURM_NODEID": str(job_nodes.index(node)),
            }
            out = None
            if args.output:
                name = args.output.replace("%t", str(rank)).replace("%n", str(n)).replace("%N", node)
                name = name.replace("%j", os.environ.get("SLURM_JOB_ID", "0"))
                if name not in files:
                    Path(name).parent.mkdir(parents=True, exist_ok=True)
                    files[name] = open(name, "a" if args.open_mode == "append" else "w")  # noqa: SIM115
                out = files[name]
            cwd = cluster["node_cwd"].get(node)
            tasks.append(
                subprocess.Popen(
                    args.command, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT if out else None
                )
            )
    return _wait_tasks(tasks)


def _wait_tasks(tasks: list[subprocess.Popen]) -> int:
    def forward(signum, _frame):
        for t in tasks:
            if t.poll() is None:
                t.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    codes = [t.wait() for t in tasks]
    return max(128 - c if c < 0 else c for c in codes)


# ---- scontrol, scancel ----------------------------------------------------------------------


def _scontrol(argv: list[str]) -> int:
    if argv[:2] != ["show", "hostnames"]:
        raise SystemExit(f"scontrol (fake): only 'show hostnames' is known, not {argv}")
    names = argv[2] if len(argv) > 2 else os.environ["SLURM_JOB_NODELIST"]
    print("\n".join(names.split(",")))
    return 0


def _scancel(argv: list[str]) -> int:
    state, _ = _cluster()
    for job in argv:
        _cancel(state, int(job))
    return 0


if __name__ == "__main__":
    handlers = {"sbatch": _sbatch, "srun": _srun, "scontrol": _scontrol, "scancel": _scancel, "_job": _job}
    raise SystemExit(handlers[sys.argv[1]](sys.argv[2:]))
