"""SWE-bench-form tasks made from any Python repository by mutation (`asyncrl swe-tasks`).

`mutate.py` makes the bugs: plausible one-spot edits of a function's source.
"""

from asyncrl.envs.swe_tasks.mutate import OPERATORS, Mutation, find_mutations

__all__ = ["OPERATORS", "Mutation", "find_mutations"]
