"""`asyncrl swe-tasks`: SWE-bench-form tasks made from any Python repository by mutation.

    from asyncrl.envs.builtin.swe.tasks import read_tasks, write_tasks
    from asyncrl.tools.swe_tasks import GenerateConfig, generate, verify_tasks
    config = GenerateConfig(repo=Path("mylib"), repo_out=Path("data/tasks-repos"), name="mylib")
    tasks, stats = generate(config)
    write_tasks("data/tasks.jsonl", tasks)             # repos relative to the file: tasks-repos/<id>
    verdicts = verify_tasks(read_tasks("data/tasks.jsonl"))   # the bug fails, the reference fix passes

The rows are the `swe` environment's format, which `asyncrl.envs.builtin.swe.tasks` owns. See
docs/envs.md, "SWE tasks".
"""

from asyncrl.tools.swe_tasks.generate import GenerateConfig, GenerateError, GenerateStats, generate
from asyncrl.tools.swe_tasks.mutate import OPERATORS, Mutation, find_mutations
from asyncrl.tools.swe_tasks.repo import rebuild_task_repos
from asyncrl.tools.swe_tasks.verify import Verdict, verify_task, verify_tasks

__all__ = [
    "OPERATORS",
    "GenerateConfig",
    "GenerateError",
    "GenerateStats",
    "Mutation",
    "Verdict",
    "find_mutations",
    "generate",
    "rebuild_task_repos",
    "verify_task",
    "verify_tasks",
]
