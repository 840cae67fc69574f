"""What a rendered Slurm job checks of its cluster before it starts any process of the run.

A job rendered by `asyncrl slurm` reads and writes the paths of the host it was rendered on: the
run directory, the model, the interpreter and its asyncrl install (and vLLM's interpreter and
worker extension). It needs them on a filesystem shared by every node and mounted at the same
path, and `[slurm] gpus_per_node` GPUs on every node. `cluster_check_lines` renders the shell that
checks both, first thing in the job:

- the head node (where sbatch runs the script) writes a fresh nonce into RUN/slurm.check and notes
  where its interpreter imports asyncrl from;
- one task on every node reads the nonce back (a node with another filesystem at that path, or
  none, reads something else), finds each path, imports asyncrl from the same place, and counts
  its GPUs: CUDA_VISIBLE_DEVICES as Slurm sets it for the step, else `nvidia-smi -L`; a node
  showing neither is not counted (a warning: CPU-only test clusters), one with fewer GPUs fails.

A failure stops the job before anything starts, naming the node and what it lacks.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from asyncrl.config import SlurmConfig
from asyncrl.run_dir import slurm_check_file

__all__ = ["cluster_check_lines", "requirements_comment"]

_IMPORT_ASYNCRL = "-c 'import asyncrl; print(asyncrl.__file__)'"


def requirements_comment(s: SlurmConfig, run_dir: Path, workdir: Path) -> list[str]:
    """The job's first comment: what it needs from the cluster (and checks at start)."""
    return [
        f"# Rendered by `asyncrl slurm` in {workdir}. It needs, and checks on every node before it",
        "# starts anything:",
        "# - a filesystem shared by every node and mounted at the same path, holding the job's working",
        f"#   directory {workdir}, the run directory {workdir / run_dir}, the model, and the interpreter",
        "#   with asyncrl (and vLLM's), at the paths they have on the submitting host;",
        f"# - {s.gpus_per_node} GPUs on every node ([slurm] gpus_per_node); the job takes whole nodes.",
    ]


def _node_check(python: str, paths: list[str], run_dir: Path, gpus_per_node: int) -> list[str]:
    """The script one task runs on every node; ASYNCRL_NONCE and ASYNCRL_PKG come from the head node."""
    check = shlex.quote(str(slurm_check_file(run_dir)))
    shared = f"{run_dir} must be on a filesystem shared by every node, mounted at the same path"
    return [
        'node="${SLURMD_NODENAME:-$(hostname)}"',
        'fail() { echo "asyncrl slurm: node $node: $*" >&2; exit 1; }',
        f'[ "$(cat {check} 2>/dev/null)" = "$ASYNCRL_NONCE" ] || '
        f"fail {shlex.quote(f'{check} does not hold what the head node just wrote: {shared}')}",
        f"for path in {' '.join(shlex.quote(p) for p in paths)}; do",
        '  [ -e "$path" ] || fail "$path not found: it must be at the same path on every node"',
        "done",
        f'pkg="$({shlex.quote(python)} {_IMPORT_ASYNCRL} 2>&1)" || '
        f'fail "{python} cannot import asyncrl: $pkg"',
        '[ "$pkg" = "$ASYNCRL_PKG" ] || fail "asyncrl is imported from $pkg here, from $ASYNCRL_PKG '
        'on the head node"',
        'if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then gpus=$(tr , "\\n" <<< "$CUDA_VISIBLE_DEVICES" | '
        "grep -c .)",
        "elif command -v nvidia-smi > /dev/null; then gpus=$(nvidia-smi -L | grep -c '^GPU')",
        'else gpus=""; fi',
        'if [ -z "$gpus" ]; then',
        '  echo "asyncrl slurm: node $node: warning: no GPU visible (no CUDA_VISIBLE_DEVICES, no '
        "nvidia-smi); "
        'GPUs not counted" >&2',
        f'elif [ "$gpus" -lt {gpus_per_node} ]; then',
        f'  fail "$gpus GPU(s) visible, but [slurm] gpus_per_node is {gpus_per_node}"',
        "fi",
        'echo "asyncrl slurm: node $node: ok (${gpus:-no} GPUs counted)"',
    ]


def cluster_check_lines(s: SlurmConfig, run_dir: Path, paths: list[str]) -> list[str]:
    """The job's cluster check (see the module docstring); `paths`: what every node must find."""
    num_nodes = s.inference_nodes + s.trainer_nodes
    run = shlex.quote(str(run_dir))
    check = shlex.quote(str(slurm_check_file(run_dir)))
    python = shlex.quote(s.python)
    missing_run = f"{run_dir} not found on the head node: the job needs it on a filesystem every node shares"
    return [
        "",
        "# cluster check: every node reads back what the head node writes (a shared filesystem at the",
        "# same path), finds the paths this job uses, imports the same asyncrl, and has its GPUs",
        f"[ -d {run} ] || {{ echo {shlex.quote(f'asyncrl slurm: {missing_run}')} >&2; exit 1; }}",
        'ASYNCRL_NONCE="$SLURM_JOB_ID.$(date +%s%N).$RANDOM"',
        f'echo "$ASYNCRL_NONCE" > {check}',
        f'ASYNCRL_PKG="$({python} {_IMPORT_ASYNCRL})" || '
        f'{{ echo "asyncrl slurm: {s.python} cannot import asyncrl on the head node" >&2; exit 1; }}',
        "export ASYNCRL_NONCE ASYNCRL_PKG",
        "read -r -d '' NODE_CHECK <<'CHECK' || true",
        *_node_check(s.python, paths, run_dir, s.gpus_per_node),
        "CHECK",
        f'srun --nodes={num_nodes} --ntasks-per-node=1 bash -c "$NODE_CHECK" || '
        '{ echo "asyncrl slurm: the cluster check failed (above); nothing was started" >&2; exit 1; }',
    ]
