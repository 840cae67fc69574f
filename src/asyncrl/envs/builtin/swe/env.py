"""`swe`: repository tasks in SWE-bench form, solved with shell and editor tools in a pooled sandbox.

    [[orchestrator.envs.envs]]
    name = "swe"
    args = { tasks = "data/swe/tasks.jsonl", partial_credit = false, sandbox = { max_sandboxes = 64 } }
    max_turns = 30

Each episode gets its own checkout of the task's repository at its base commit (`checkout.py`) in
a sandbox of the env's `SandboxPool`, mounted at /repo, with the tools of `tools.py`. Rewards
(`grading.py`): `resolved` (every FAIL_TO_PASS and PASS_TO_PASS test passes), or with
`partial_credit` the fraction of FAIL_TO_PASS passing when every PASS_TO_PASS test passes (else 0).
Reported beside it (weight 0): fail_to_pass, pass_to_pass, submitted, grading_error, test_run_s,
sandbox_start_s, sandbox_warm. Task rows: `tasks.py`; splits and order: `asyncrl.envs.task_data`.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from asyncrl.envs.base import EnvConfigError, Environment, EpisodeState, Reward, Rubric, Split, Task
from asyncrl.envs.builtin.swe.checkout import GitCheckout, GitSource
from asyncrl.envs.builtin.swe.grading import Grade, grade_episode, write_python_shim
from asyncrl.envs.builtin.swe.reference import reference_messages
from asyncrl.envs.builtin.swe.tasks import SweTask, resolve_commits
from asyncrl.envs.builtin.swe.tools import make_tools
from asyncrl.envs.sandbox import SandboxResult
from asyncrl.envs.sandbox_pool import PooledSandbox, PoolLimits, SandboxPool
from asyncrl.envs.task_data import TaskDataConfig, TaskTable
from asyncrl.envs.tools import Tool, ToolError

__all__ = ["SandboxSettings", "SweEnv"]

log = logging.getLogger(__name__)

MOUNT_POINT = "/repo"
SHIM_DIR = "/opt/asyncrl/bin"  # where the `python` shim of the task's interpreter appears in the sandbox
METRICS = (
    "fail_to_pass",
    "pass_to_pass",
    "submitted",
    "grading_error",
    "test_run_s",
    "sandbox_start_s",
    "sandbox_warm",
)
_MB = 1 << 20
PROMPT = """You are working in a Python repository at /repo. Resolve the issue below, so that the \
repository's tests pass.

<issue>
{problem_statement}
</issue>

Explore the code (view, search, bash), edit it (str_replace, create) and run tests with bash. Do \
not edit the tests: they are restored before grading. Call submit when you are done."""


class SandboxSettings(BaseModel):
    """The `sandbox` table of the env's args: the pool and the limits of each sandbox."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_sandboxes: int = Field(64, ge=1, description="sandboxes alive at once (busy, idle or being made)")
    prewarm: int = Field(
        2, ge=0, description="when task i starts, make a sandbox ready for tasks i+1..i+prewarm"
    )
    root: str | None = Field(
        None, description="where run directories live (default: $TMPDIR/asyncrl-sandboxes)"
    )
    memory_mb: int = Field(2048, ge=64, description="per sandbox (cgroup) or per process (RLIMIT_AS)")
    max_processes: int = Field(256, ge=8, description="per sandbox (cgroup pids.max)")
    disk_mb: int = Field(1024, ge=16, description="per sandbox (tmpfs size, or checked after each command)")
    cpu_s: int = Field(600, ge=1, description="RLIMIT_CPU of each process")
    tmp_mb: int = Field(64, ge=1, description="/tmp inside, a fresh tmpfs per command")

    def limits(self, command_timeout_s: float) -> PoolLimits:
        return PoolLimits(
            command_wall_s=command_timeout_s,
            cpu_s=self.cpu_s,
            memory_bytes=self.memory_mb * _MB,
            max_processes=self.max_processes,
            disk_bytes=self.disk_mb * _MB,
            tmp_bytes=self.tmp_mb * _MB,
        )


def _settings(sandbox: dict[str, Any] | SandboxSettings) -> SandboxSettings:
    if isinstance(sandbox, SandboxSettings):
        return sandbox
    try:
        return SandboxSettings.model_validate(sandbox)
    except ValidationError as e:
        problems = "; ".join(".".join(["sandbox", *map(str, x["loc"])]) + f": {x['msg']}" for x in e.errors())
        raise EnvConfigError(f"swe: bad sandbox settings: {problems}") from None


def _python_binds(venv: Path | None) -> tuple[tuple[str, str], ...]:
    """Read-only binds for a task's own Python environment: the venv and the interpreter it links to."""
    if venv is None:
        return ()
    base = Path(os.path.realpath(venv / "bin" / "python")).parent.parent
    roots = {str(venv.resolve())} | ({str(base)} if not str(base).startswith("/usr") else set())
    return tuple((r, r) for r in sorted(roots))


def _load_tasks(
    tasks: str, eval_tasks: str | None, *, seed: int, shuffle: bool
) -> tuple[TaskTable, dict[tuple[Split, str], SweTask]]:
    """The split table of the rows, and every row checked, keyed by (split, where)."""
    data = TaskDataConfig(
        path=tasks, eval_path=eval_tasks, prompt_field="problem_statement", answer_field="", shuffle=shuffle
    )
    table = TaskTable.load(data, seed=seed)
    # a row's relative repo and venv paths are taken from the directory of its own tasks file
    files: dict[Split, str] = {"train": tasks, "eval": eval_tasks or tasks}
    base_dirs = {split: Path(path).expanduser().absolute().parent for split, path in files.items()}
    rows = {
        (split, row.where): SweTask.from_row(row.row, where=row.where, base_dir=base_dirs[split])
        for split in base_dirs
        for row in (table.row(split, i) for i in range(table.size(split)))
    }
    return table, rows


class SweEnv(Environment):
    name = "swe"
    max_turns = 30

    def __init__(
        self,
        *,
        tasks: str,
        eval_tasks: str | None = None,
        seed: int = 0,
        partial_credit: bool = False,
        command_timeout_s: float = 60.0,
        test_timeout_s: float = 600.0,
        max_output_chars: int = 3000,
        shuffle: bool = True,
        sandbox: dict[str, Any] | SandboxSettings | None = None,
    ) -> None:
        """`tasks` / `eval_tasks`: JSONL, JSON or Parquet files of rows (see `tasks.py`); without
        `eval_tasks`, 1 row in 8 goes to eval by a hash of its content."""
        super().__init__(seed=seed)
        self.settings = _settings(sandbox or {})
        self.partial_credit = partial_credit
        self.command_timeout_s, self.test_timeout_s = command_timeout_s, test_timeout_s
        self.max_output_chars = max_output_chars
        self.table, self._tasks = _load_tasks(tasks, eval_tasks, seed=seed, shuffle=shuffle)
        self.pool = SandboxPool(
            root=self.settings.root,
            max_sandboxes=self.settings.max_sandboxes,
            mount_point=MOUNT_POINT,
            limits=self.settings.limits(command_timeout_s),
        )
        try:
            self._sources = resolve_commits(self._tasks, import_dir=self.pool.run_dir.path / "imports")
        except BaseException:
            self.pool.close()
            raise
        venvs = sorted({t.venv for t in self._tasks.values()}, key=str)
        self._shims = {
            venv: write_python_shim(
                self.pool.run_dir.path / "python" / str(i),
                str(venv / "bin" / "python") if venv else sys.executable,
            )
            for i, venv in enumerate(venvs)
        }
        isolation = "; ".join(f"{k}: {v}" for k, v in self.pool.isolation().items())
        log.info("swe: %d tasks; sandboxes: %s", len(self._tasks), isolation)
        reward = "partial" if partial_credit else "resolved"
        self.rubric = Rubric(
            rewards=(
                Reward(name=reward, fn=self._reward(reward)),
                *(Reward(name=m, fn=self._reward(m), weight=0.0) for m in METRICS),
            )
        )

    def close(self) -> None:
        """Remove every sandbox of this env now (also done at interpreter exit)."""
        self.pool.close()

    # -- tasks -----------------------------------------------------------------------------------

    def task(self, split: Split, index: int) -> Task:
        row = self.table.row(split, index)
        swe = self._tasks[(split, row.where)]
        prompt = [{"role": "user", "content": PROMPT.format(problem_statement=swe.problem_statement.strip())}]
        info = {"instance_id": swe.instance_id, "row": (split, row.where), "split": split, "index": index}
        return Task(id=f"{self.name}/{split}/{index}", prompt=prompt, info=info)

    def swe_task(self, task: Task) -> SweTask:
        return self._tasks[task.info["row"]]

    def checkout(self, task: Task) -> GitCheckout:
        source, commit = self._sources[task.info["row"]]
        return GitCheckout(source=source, commit=commit)

    def reference(self, task: Task) -> list[dict[str, Any]]:
        """Tool calls that apply the task's reference patch, then submit, with the exact tool replies."""
        source: GitSource = self._sources[task.info["row"]][0]
        return reference_messages(
            self.swe_task(task), source, self.checkout(task).commit, max_chars=self.max_output_chars
        )

    # -- episodes --------------------------------------------------------------------------------

    async def setup(self, task: Task) -> EpisodeState:
        box = await self.pool.acquire(self.checkout(task))
        split, index = task.info["split"], task.info["index"]
        for ahead in range(1, self.settings.prewarm + 1):
            self.pool.prewarm(self.checkout(self.task(split, index + ahead)), 1)
        data = {
            "sandbox": box,
            "swe": self.swe_task(task),
            "checkout": self.checkout(task),
            "submitted": False,
        }
        return EpisodeState(task=task, messages=list(task.prompt), data=data)

    async def teardown(self, state: EpisodeState) -> None:
        if "sandbox" in state.data:
            self.pool.release(state.data["sandbox"])

    def sandbox_env(self, state: EpisodeState) -> dict[str, str]:
        """The environment of a command in the episode's sandbox."""
        swe: SweTask = state.data["swe"]
        box: PooledSandbox = state.data["sandbox"]
        prefix = str(swe.venv.resolve()) if swe.venv else sys.prefix
        paths = [MOUNT_POINT, *([f"{MOUNT_POINT}/src"] if (box.work / "src").is_dir() else [])]
        return {
            "PATH": f"{SHIM_DIR}:{prefix}/bin:/usr/local/bin:/usr/bin:/bin",
            "HOME": "/tmp",
            "TMPDIR": "/tmp",
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONPATH": ":".join(paths),
        }

    def _read_only(self, swe: SweTask) -> tuple[tuple[str, str], ...]:
        """What a command of the task's sandbox sees read-only: its Python environment and `python` shim."""
        return (*_python_binds(swe.venv), (str(self._shims[swe.venv]), SHIM_DIR))

    def tools(self, state: EpisodeState) -> list[Tool]:
        """The episode's tools; without a sandbox (SFT export reads only their schemas) they refuse to run."""
        box: PooledSandbox | None = state.data.get("sandbox")
        binds = self._read_only(self.swe_task(state.task))

        async def run(command: str) -> SandboxResult:
            if box is None:
                raise ToolError("this episode has no sandbox")
            argv = ["bash", "-c", f"exec 2>&1; {command}"]
            return await box.run(
                argv, env=self.sandbox_env(state), timeout_s=self.command_timeout_s, read_only=binds
            )

        def submit() -> None:
            state.data["submitted"], state.done = True, True

        return make_tools(
            work=box.work if box else Path(MOUNT_POINT),
            mount_point=MOUNT_POINT,
            run=run,
            submit=submit,
            max_chars=self.max_output_chars,
            max_file_bytes=self.pool.limits.max_file_bytes,
        )

    # -- rewards ---------------------------------------------------------------------------------

    async def grade(self, state: EpisodeState) -> Grade:
        """The episode's grade, computed once (every reward reads it)."""
        if "grade" not in state.data:
            swe: SweTask = state.data["swe"]
            state.data["grade"] = await grade_episode(
                state.data["sandbox"],
                state.data["checkout"],
                swe,
                env=self.sandbox_env(state),
                timeout_s=self.test_timeout_s,
                read_only=self._read_only(swe),
            )
            if state.data["grade"].error:
                log.warning("swe %s: %s", swe.instance_id, state.data["grade"].error)
        return state.data["grade"]

    def _reward(self, name: str):
        async def value(state: EpisodeState) -> float:
            grade = await self.grade(state)
            box: PooledSandbox = state.data["sandbox"]
            return {
                "resolved": float(grade.resolved),
                "partial": grade.fail_to_pass if grade.pass_to_pass == 1.0 else 0.0,
                "fail_to_pass": grade.fail_to_pass,
                "pass_to_pass": grade.pass_to_pass,
                "submitted": float(state.data["submitted"]),
                "grading_error": float(grade.error is not None),
                "test_run_s": grade.test_run_s,
                "sandbox_start_s": box.start_latency_s,
                "sandbox_warm": float(box.warm),
            }[name]

        return value
