"""`swe-lite`: a tiny repository with a failing unit test; tools list_files/read_file/write_file/run_tests.

Reward = fraction of the task's tests passing at the end, measured on pristine copies of the test
files and runner (edits to tests do not count). Tool code runs in `asyncrl.envs.sandbox`. Tasks
come from bug templates (`templates.py`): off-by-one, wrong operator, missing case, ...
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

from asyncrl.envs.base import Environment, EpisodeState, Reward, Rubric, Split, Task, draw_in_split, task_rng
from asyncrl.envs.builtin.swe_lite.templates import TEMPLATES, RenderedRepo
from asyncrl.envs.sandbox import Sandbox, SandboxLimits
from asyncrl.envs.tools import Tool, ToolError

__all__ = ["SweLiteEnv", "format_report"]

_RUNNER_NAME = "_run_tests.py"
_RUNNER_SOURCE = Path(__file__).with_name("runner.py").read_text()


def format_report(results: list[tuple[str, bool, str]]) -> str:
    """What `run_tests` shows the model: one line per test, then a count."""
    lines = [f"PASS {name}" if ok else f"FAIL {name}: {err}" for name, ok, err in results]
    passed = sum(ok for _, ok, _ in results)
    return "\n".join([*lines, f"{passed} passed, {len(results) - passed} failed"])


def _repo_files(repo: RenderedRepo) -> dict[str, str]:
    return {f"{repo.module}.py": repo.buggy, f"test_{repo.module}.py": repo.tests}


async def _run_tests(sandbox: Sandbox, expected: tuple[str, ...]) -> list[tuple[str, bool, str]]:
    """(test name, passed, error) for every test that ran, then the expected tests that did not
    run (failed, with the reason)."""
    nonce = secrets.token_hex(8)
    result = await sandbox.run_python(_RUNNER_NAME, stdin=nonce + "\n")
    outcome: dict[str, tuple[bool, str]] = {}
    import_errors: list[str] = []
    for line in result.stdout.splitlines():
        if line.startswith(nonce + " "):
            status, _, rest = line[len(nonce) + 1 :].partition(" ")
            name, _, err = rest.partition(": ")
            if status == "ERROR":
                import_errors.append(f"cannot import {name}: {err}")
            else:
                outcome[name] = (status == "PASS", err)
    problem = result.error_summary() or (import_errors[0] if import_errors else "test did not run")
    ran = [(name, ok, err) for name, (ok, err) in outcome.items()]
    return ran + [(name, False, problem) for name in expected if name not in outcome]


class SweLiteEnv(Environment):
    name = "swe-lite"
    max_turns = 12

    def __init__(
        self, *, seed: int = 0, cpu_s: int = 5, wall_s: float = 20.0, allow_weak_isolation: bool = False
    ) -> None:
        """`allow_weak_isolation`: run tool code without bwrap where it is unavailable (guard only)."""
        super().__init__(seed=seed)
        self.limits = SandboxLimits(cpu_s=cpu_s, wall_s=wall_s)
        self.allow_weak_isolation = allow_weak_isolation
        self.rubric = Rubric(rewards=(Reward(name="tests_passed", fn=self._tests_passed),))

    def _repo(self, task: Task) -> RenderedRepo:
        template = TEMPLATES[task.info["template"]]
        return template.render(task.info["function"], task.info["module"])

    def task(self, split: Split, index: int) -> Task:
        rng = task_rng(self.seed, self.name, split, index)

        def draw() -> tuple[int, str, str]:
            t = rng.randrange(len(TEMPLATES))
            return t, rng.choice(TEMPLATES[t].names), rng.choice(TEMPLATES[t].modules)

        t, fn, module = draw_in_split(
            draw, lambda x: f"{self.name}/{x[0]}/{x[1]}/{x[2]}", split, env=self.name
        )
        content = (
            f"The tests in test_{module}.py fail. Find and fix the bug in {module}.py using the tools. "
            "When the tests pass, reply with a short summary and no tool call."
        )
        info = {"template": t, "function": fn, "module": module, "kind": TEMPLATES[t].kind}
        return Task(
            id=f"{self.name}/{split}/{index}", prompt=[{"role": "user", "content": content}], info=info
        )

    async def setup(self, task: Task) -> EpisodeState:
        sandbox = Sandbox(limits=self.limits, allow_weak_isolation=self.allow_weak_isolation)
        repo = self._repo(task)
        for path, content in _repo_files(repo).items():
            sandbox.write_file(path, content)
        sandbox.write_file(_RUNNER_NAME, _RUNNER_SOURCE)
        return EpisodeState(task=task, messages=list(task.prompt), data={"sandbox": sandbox, "repo": repo})

    async def teardown(self, state: EpisodeState) -> None:
        if "sandbox" in state.data:
            state.data["sandbox"].close()

    def tools(self, state: EpisodeState) -> list[Tool]:
        def sandbox() -> Sandbox:
            return state.data["sandbox"]

        def list_files() -> str:
            """List the files of the repository."""
            return "\n".join(f for f in sandbox().list_files() if f != _RUNNER_NAME)

        def read_file(path: str) -> str:
            """Read a file of the repository."""
            return sandbox().read_file(path)

        def write_file(path: str, content: str) -> str:
            """Replace the whole content of a file (or create it)."""
            if path == _RUNNER_NAME:
                raise ToolError(f"{path} is reserved")
            return f"wrote {sandbox().write_file(path, content)} bytes to {path}"

        async def run_tests() -> str:
            """Run the unit tests and show which pass."""
            return format_report(await _run_tests(sandbox(), state.data["repo"].test_names))

        return [Tool.from_function(f) for f in (list_files, read_file, write_file, run_tests)]

    async def _tests_passed(self, state: EpisodeState) -> float:
        repo: RenderedRepo = state.data["repo"]
        sandbox: Sandbox = state.data["sandbox"]
        sandbox.write_file(f"test_{repo.module}.py", repo.tests)
        sandbox.write_file(_RUNNER_NAME, _RUNNER_SOURCE)
        results = await _run_tests(sandbox, repo.test_names)
        passed = {name for name, ok, _ in results if ok}
        return sum(name in passed for name in repo.test_names) / len(repo.test_names)

    def reference(self, task: Task) -> list[dict[str, Any]]:
        repo = self._repo(task)
        path = f"{repo.module}.py"

        def call(name: str, **arguments: str) -> dict[str, Any]:
            body = json.dumps({"name": name, "arguments": arguments})
            return {"role": "assistant", "content": f"<tool_call>{body}</tool_call>"}

        def result(name: str, content: str) -> dict[str, Any]:
            return {"role": "tool", "name": name, "content": content}

        report = format_report([(name, True, "") for name in repo.test_names])
        return [
            call("read_file", path=path),
            result("read_file", repo.buggy),
            call("write_file", path=path, content=repo.fixed),
            result("write_file", f"wrote {len(repo.fixed.encode())} bytes to {path}"),
            call("run_tests"),
            result("run_tests", report),
            {"role": "assistant", "content": f"Fixed the {task.info['kind']} bug in {path}; all tests pass."},
        ]
