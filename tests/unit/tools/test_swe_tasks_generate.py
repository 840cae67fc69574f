"""`asyncrl swe-tasks` end to end on a tiny package written here: rows that verify, statements
that hide the fix, repositories at the buggy state. About 15-25 s on 2 shared cores: each pytest
run it starts costs about a second."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest

from asyncrl.envs.builtin.swe.tasks import read_tasks
from asyncrl.tools.swe_tasks import GenerateConfig, GenerateError, generate, verify_task, verify_tasks
from asyncrl.tools.swe_tasks.cli import main
from asyncrl.tools.swe_tasks.statement import fix_lines, leaks_fix

OPS = '''"""Small helpers."""


def clamp(x, lo=0, hi=10):
    if x < lo:
        return lo
    if x > hi:
        return hi
    return x


def mean(xs):
    if not xs:
        raise ValueError("mean of nothing")
    return sum(xs) / len(xs)


def chunks(xs, n=2):
    return [xs[i : i + n] for i in range(0, len(xs), n)]


def untested(a, b):
    return a - b
'''

TESTS = """import pytest

from calc.ops import chunks, clamp, mean


def test_clamp_inside():
    assert clamp(5) == 5


def test_clamp_edges():
    assert clamp(-1) == 0
    assert clamp(11) == 10


def test_mean():
    assert mean([1, 2, 3]) == 2


def test_mean_empty():
    with pytest.raises(ValueError, match="mean of nothing"):
        mean([])


@pytest.mark.parametrize("n", [1, 2])
def test_chunks(n):
    assert sum(chunks([1, 2, 3], n), []) == [1, 2, 3]
    assert len(chunks([1, 2, 3], n)) == 4 - n


def test_fails_anyway():
    assert False
"""


def write_package(root: Path, tests: str = TESTS) -> Path:
    (root / "calc").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "calc" / "__init__.py").write_text("")
    (root / "calc" / "ops.py").write_text(OPS)
    (root / "tests" / "test_ops.py").write_text(tests)
    return root


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("gen")
    repo = write_package(tmp / "calc-1.0")
    out = tmp / "out" / "tasks.jsonl"
    assert (
        main(["--repo", str(repo), "--out", str(out), "--max-tasks", "3", "--jobs", "2", "--name", "calc"])
        == 0
    )
    return repo, out


def test_rows_verify_bug_fails_and_reference_fix_passes(made: tuple[Path, Path]):
    _, out = made
    tasks = read_tasks(out)
    assert len(tasks) == 3
    assert {t.mutation["function"] for t in tasks} <= {
        "clamp",
        "mean",
        "chunks",
    }  # untested() is never mutated
    verdicts = verify_tasks(tasks, jobs=2, log=lambda _: None)
    for task, v in zip(tasks, verdicts):
        assert v.ok, v.problems
        assert (v.f2p_before, v.f2p_after, v.p2p_before, v.p2p_after) == (0.0, 1.0, 1.0, 1.0)
        assert not set(task.fail_to_pass) & set(task.pass_to_pass)
        assert "tests/test_ops.py::test_fails_anyway" not in task.pass_to_pass  # it never passed
        assert task.instance_id.startswith("calc__calc.ops.")


def test_statements_show_the_symptom_not_the_fix(made: tuple[Path, Path]):
    _, out = made
    for task in read_tasks(out):
        statement = task.problem_statement
        assert not leaks_fix(statement, task.patch)
        assert task.patch not in statement and "@@" not in statement
        for line in fix_lines(task.patch):
            assert line not in statement
        assert all(test_id in statement for test_id in task.fail_to_pass)
        assert "traceback" in statement or "did not run" in statement


def test_each_repository_holds_only_the_buggy_state(made: tuple[Path, Path]):
    repo, out = made
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["repo"] for r in rows] == [
        f"tasks-repos/{r['instance_id']}" for r in rows
    ]  # from OUT's directory
    for task in read_tasks(out):
        checkout = task.repo
        assert checkout == out.parent / "tasks-repos" / task.instance_id
        commits = subprocess.run(["git", "rev-list", "--all"], cwd=checkout, capture_output=True, text=True)
        assert commits.stdout.split() == [task.base_commit]  # no history, no other task's files
        buggy = (checkout / "calc" / "ops.py").read_text()
        assert buggy != OPS and (checkout / "tests" / "test_ops.py").read_text() == TESTS
        subprocess.run(["git", "apply", "-"], cwd=checkout, input=task.patch, text=True, check=True)
        assert (checkout / "calc" / "ops.py").read_text() == OPS  # the patch restores the original
        subprocess.run(["git", "checkout", "-q", "--", "."], cwd=checkout, check=True)
    assert (repo / "calc" / "ops.py").read_text() == OPS  # the source repository is only read


def test_verify_reports_a_row_whose_tests_do_not_fail_on_the_bug(made: tuple[Path, Path], tmp_path: Path):
    _, out = made
    task = read_tasks(out)[0]
    wrong = dataclasses.replace(task, fail_to_pass=(*task.fail_to_pass, task.pass_to_pass[0]))
    verdict = verify_task(wrong)
    assert not verdict.ok
    assert verdict.problems == (f"FAIL_TO_PASS {task.pass_to_pass[0]} passes before the patch",)
    unfixed = dataclasses.replace(task, patch="")
    assert verify_task(unfixed).problems[0].endswith("is failed after the patch")


def test_a_repository_without_passing_tests_is_an_error(tmp_path: Path):
    repo = write_package(tmp_path / "broken", tests="def test_nothing_passes():\n    assert False\n")
    cfg = GenerateConfig(repo=repo, repo_out=tmp_path / "repos", name="broken")
    with pytest.raises(GenerateError, match="no test passed in .* the output ends with"):
        generate(cfg, log=lambda _: None)


def test_a_used_repo_out_is_refused_before_any_run(tmp_path: Path):
    (tmp_path / "repos").mkdir()
    (tmp_path / "repos" / "old").mkdir()
    cfg = GenerateConfig(repo=tmp_path, repo_out=tmp_path / "repos", name="x")
    with pytest.raises(GenerateError, match="which is not empty: remove it or pass another --repo-out"):
        generate(cfg, log=lambda _: None)


def test_leaks_fix_catches_a_line_of_the_fix_and_statements_drop_addresses():
    from asyncrl.tools.swe_tasks.runner import Failure
    from asyncrl.tools.swe_tasks.statement import problem_statement

    patch = "--- a/m.py\n+++ b/m.py\n@@ -1,2 +1,2 @@\n def f(a, b):\n-    return a - b\n+    return a + b\n"
    assert leaks_fix("the code should say: return a + b", patch)
    assert not leaks_fix("f(1, 2) returned -1, expected 3", patch)
    failure = Failure(
        when="call",
        error="assert <function f at 0x7f00deadbeef> == 3",
        frames=(("tests/test_m.py", 4, "test_f"), ("m.py", 2, "f")),
    )
    statement = problem_statement(
        ["tests/test_m.py::test_f"], {"tests/test_m.py::test_f": failure}, "pytest {tests}"
    )
    assert "<function f at 0x...>" in statement and "0x7f00" not in statement
    assert "      m.py:2 in f" in statement and "a test fails" in statement


def test_a_mutant_is_kept_only_if_it_breaks_its_own_tests_and_nothing_else():
    from asyncrl.tools.swe_tasks.generate import _Candidate, _classify
    from asyncrl.tools.swe_tasks.mutate import find_mutations
    from asyncrl.tools.swe_tasks.runner import CommandRun, ProbeRun

    (mutation,) = find_mutations(OPS, "calc/ops.py", ("swap-arguments",))[:1]
    cand = _Candidate(
        path="calc/ops.py",
        function="chunks",
        original=OPS,
        mutations=(mutation,),
        tests=("t::covering", "t::covering2"),
        others=("t::other",),
    )
    cfg = GenerateConfig(repo=Path("."), repo_out=Path("repos"), name="calc")

    def classify(outcomes: dict[str, str]) -> tuple[str, object]:
        run = CommandRun(output="", returncode=1, wall_s=1.0, timed_out=False)
        return _classify(cand, mutation, ProbeRun(outcomes=outcomes, failures={}, called={}, run=run), cfg)

    passed = {"t::covering": "passed", "t::covering2": "passed", "t::other": "passed"}
    assert classify(passed)[0] == "survived"
    outcome, kill = classify(passed | {"t::covering": "failed"})
    assert outcome == "killed"
    assert kill.failing == ("t::covering",) and kill.still_passing == ("t::covering2", "t::other")
    # a test that does not run the function fails: the mutant broke more than the function
    assert classify(passed | {"t::covering": "failed", "t::other": "failed"})[0] == "collateral"
    # a test of the run reported nothing: the run itself broke
    assert classify({"t::covering": "failed", "t::covering2": "passed"})[0] == "error"
