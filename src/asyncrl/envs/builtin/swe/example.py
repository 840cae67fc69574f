"""A two-task example in SWE-bench form: a tiny git repository with two planted bugs, and its tasks file.

    python -m asyncrl.envs.builtin.swe.example /tmp/swe-example    # prints /tmp/swe-example/tasks.jsonl

`calclib` has `add`, `clamp` and `mean` with pytest tests. Task `calclib-clamp` starts from a
commit where `clamp` caps at `hi - 1` (its tests already exist: empty test patch); task
`calclib-mean` starts from one where `mean([])` divides by zero, and its test patch adds the test
for it. Both reference patches restore the original code. Used by the tests, the benchmark and
the docs' quick start; real task sets come from `asyncrl swe-tasks` or SWE-bench-style data.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from asyncrl.envs.builtin.swe.checkout import git

__all__ = ["TEST_CMD", "write_example"]

TEST_CMD = "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -q -p no:cacheprovider {tests}"
_OPS = '''def add(a, b):
    """Sum of a and b."""
    return a + b


def clamp(x, lo, hi):
    """x limited to the interval [lo, hi]."""
    return max(lo, min(x, hi))


def mean(xs):
    """Arithmetic mean of xs; 0.0 for an empty list."""
    if not xs:
        return 0.0
    return sum(xs) / len(xs)
'''
_TESTS = """from calclib.ops import add, clamp, mean


def test_add():
    assert add(2, 3) == 5


def test_clamp_inside():
    assert clamp(5, 0, 10) == 5


def test_clamp_low():
    assert clamp(-2, 0, 10) == 0


def test_clamp_high():
    assert clamp(12, 0, 10) == 10


def test_mean():
    assert mean([1, 2, 3]) == 2
"""
_MEAN_EMPTY_TEST = "\n\ndef test_mean_empty():\n    assert mean([]) == 0.0\n"
_TEST_FILE = "tests/test_ops.py"
_ALL = ("test_add", "test_clamp_inside", "test_clamp_low", "test_clamp_high", "test_mean")


def _commit(repo: Path, files: dict[str, str], message: str) -> str:
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    git("add", "-A", cwd=repo)
    git("commit", "-q", "-m", message, cwd=repo)
    return git("rev-parse", "HEAD", cwd=repo).strip()


def _ids(*names: str) -> list[str]:
    return [f"{_TEST_FILE}::{n}" for n in names]


def write_example(dest: Path) -> Path:
    """Write `dest/calclib` (a git repository) and `dest/tasks.jsonl`; the path of the tasks file."""
    repo = dest / "calclib"
    repo.mkdir(parents=True)
    git("init", "-q", "-b", "main", cwd=repo)
    good = _commit(repo, {"calclib/__init__.py": "", "calclib/ops.py": _OPS, _TEST_FILE: _TESTS}, "calclib")
    clamp_bug = _commit(repo, {"calclib/ops.py": _OPS.replace("min(x, hi)", "min(x, hi - 1)")}, "clamp")
    git("checkout", "-q", good, cwd=repo)
    mean_bug = _commit(
        repo, {"calclib/ops.py": _OPS.replace("    if not xs:\n        return 0.0\n", "")}, "mean"
    )
    with_test = _commit(repo, {_TEST_FILE: _TESTS + _MEAN_EMPTY_TEST}, "mean test")
    git("checkout", "-q", "main", cwd=repo)
    rows = [
        {
            "instance_id": "calclib-clamp",
            "repo": "calclib",
            "base_commit": clamp_bug,
            "problem_statement": "clamp(x, lo, hi) returns hi - 1 instead of hi when x is above hi.",
            "patch": git("diff", clamp_bug, good, cwd=repo),
            "test_patch": "",
            "FAIL_TO_PASS": _ids("test_clamp_high"),
            "PASS_TO_PASS": _ids(*(n for n in _ALL if n != "test_clamp_high")),
            "test_cmd": TEST_CMD,
        },
        {
            "instance_id": "calclib-mean",
            "repo": "calclib",
            "base_commit": mean_bug,
            "problem_statement": "mean([]) raises ZeroDivisionError; it should return 0.0 for an empty list.",
            "patch": git("diff", mean_bug, good, "--", "calclib", cwd=repo),
            "test_patch": git("diff", mean_bug, with_test, cwd=repo),
            "FAIL_TO_PASS": _ids("test_mean_empty"),
            "PASS_TO_PASS": _ids(*_ALL),
            "test_cmd": TEST_CMD,
        },
    ]
    tasks = dest / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tasks


if __name__ == "__main__":
    print(write_example(Path(sys.argv[1])))
