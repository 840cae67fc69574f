"""SWE-bench-form tasks made from any Python repository by mutation (`asyncrl swe-tasks`).

    from asyncrl.envs.swe_tasks import GenerateConfig, generate, read_tasks, verify_tasks
    tasks, stats = generate(GenerateConfig(repo=Path("mylib"), repo_out=Path("tasks-repos"), name="mylib"))
    write_tasks("tasks.jsonl", tasks)
    verdicts = verify_tasks(read_tasks("tasks.jsonl"))   # the bug fails, the reference fix passes

The row format (`rows.py`) is what the `swe` environment reads. See docs/envs.md, "Making SWE tasks".
"""

from asyncrl.envs.swe_tasks.generate import GenerateConfig, GenerateError, GenerateStats, generate
from asyncrl.envs.swe_tasks.mutate import OPERATORS, Mutation, find_mutations
from asyncrl.envs.swe_tasks.repo import rebuild_task_repos
from asyncrl.envs.swe_tasks.rows import (
    DEFAULT_TEST_CMD,
    SweTask,
    SweTaskError,
    format_test_cmd,
    parse_test_outcomes,
    read_tasks,
    resolve_repo,
    write_tasks,
)
from asyncrl.envs.swe_tasks.verify import Verdict, verify_task, verify_tasks

__all__ = [
    "DEFAULT_TEST_CMD",
    "OPERATORS",
    "GenerateConfig",
    "GenerateError",
    "GenerateStats",
    "Mutation",
    "SweTask",
    "SweTaskError",
    "Verdict",
    "find_mutations",
    "format_test_cmd",
    "generate",
    "parse_test_outcomes",
    "read_tasks",
    "rebuild_task_repos",
    "resolve_repo",
    "verify_task",
    "verify_tasks",
    "write_tasks",
]
