"""Making tasks from a repository, the way SWE-smith does: mutate covered functions, keep the mutants
that break passing tests.

1. Snapshot the repository's files into a scratch git store (the repository is only read) and run
   its whole test suite once, with the probe plugin: which tests pass, and which functions each
   passing test runs (a profile hook, no coverage package needed).
2. For every function (or method) that passing tests run, outside the test files: its mutants
   (`mutate.py`), tried in a seeded order that takes the operators in turn.
3. Each mutant is written into a scratch checkout, and the tests that cover its function run with a
   seeded sample of the other passing tests. A mutant that makes some covering tests fail and
   leaves every other test of the run passing becomes a task: FAIL_TO_PASS = the failing tests,
   PASS_TO_PASS = the rest of the run (up to a cap). One that passes them all, times out, breaks
   the run or a test that does not even call the function is dropped, and the function's next
   mutant is tried.
4. For each task: the reference patch (mutant -> original), a problem statement from the failures
   (never the fix: a statement that would hold a line of it drops the mutant), and a repository of
   its own at `<repo_out>/<instance_id>` whose one commit (`base_commit`) is the buggy state. Each
   row's bug thus fails its FAIL_TO_PASS and passes its PASS_TO_PASS by construction; `--verify`
   checks the rows again from their repositories, the reference fix included.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import random
import re
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from asyncrl.envs.builtin.swe.tasks import DEFAULT_TEST_CMD, TESTS_PLACEHOLDER, SweTask
from asyncrl.tools.swe_tasks.mutate import OPERATORS, Mutation, find_functions, mutate_function
from asyncrl.tools.swe_tasks.repo import build_task_repo, export_tree, snapshot, unified_diff
from asyncrl.tools.swe_tasks.runner import ProbeRun, TestRunner
from asyncrl.tools.swe_tasks.statement import leaks_fix, problem_statement

__all__ = ["GenerateConfig", "GenerateError", "GenerateStats", "generate", "is_test_file"]

Log = Callable[[str], None]
FunctionKey = tuple[str, int]  # (path relative to the repository, first line): a code object's identity


class GenerateError(ValueError):
    """The repository or the options cannot make tasks; the message says what to change."""


@dataclass(frozen=True, kw_only=True)
class GenerateConfig:
    repo: Path  # the repository (or directory) to make tasks from; only read
    repo_out: Path  # one task repository per task is made under it
    name: str  # instance ids start with it
    max_tasks: int = 30
    seed: int = 0
    jobs: int = 1  # mutants tried in parallel, each in a checkout of its own
    test_cmd: str = DEFAULT_TEST_CMD
    max_pass_to_pass: int = 50  # 0: every test that still passes
    max_per_function: int = 1  # tasks made from one function
    max_tries_per_function: int = 6  # mutants tried on a function before moving on
    operators: tuple[str, ...] = tuple(OPERATORS)
    timeout_s: float = 60.0  # per run of a mutant's tests
    baseline_timeout_s: float = 900.0  # the whole suite, traced

    def check(self) -> None:
        if not self.repo.is_dir():
            raise GenerateError(f"--repo {self.repo}: not a directory")
        if self.repo_out.exists() and any(self.repo_out.iterdir()):
            raise GenerateError(
                f"task repositories go to {self.repo_out}, which is not empty: remove it or pass another "
                "--repo-out"
            )
        if TESTS_PLACEHOLDER not in self.test_cmd:
            raise GenerateError(f"--test-cmd {self.test_cmd!r} needs a {TESTS_PLACEHOLDER} placeholder")
        if self.max_tasks < 1 or self.jobs < 1 or self.max_per_function < 1 or self.max_pass_to_pass < 0:
            raise GenerateError(
                "--max-tasks, --jobs and --max-per-function must be >= 1, --max-pass-to-pass >= 0"
            )
        unknown = sorted(set(self.operators) - set(OPERATORS))
        if unknown:
            raise GenerateError(f"unknown --operators {unknown}; choose from {list(OPERATORS)}")


@dataclass
class GenerateStats:
    num_tests: int = 0
    num_passing: int = 0
    baseline_s: float = 0.0
    num_functions: int = 0  # covered by passing tests, with at least one mutant
    num_mutants: int = 0  # of those functions
    # Per tried mutant: killed (a task), survived, timeout, error, collateral, leaky (see _classify).
    outcomes: Counter = field(default_factory=Counter)
    mutant_run_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class _Candidate:
    path: str
    function: str
    original: str  # the file's source
    mutations: tuple[Mutation, ...]  # in trial order
    tests: tuple[str, ...]  # passing tests that run the function
    others: tuple[str, ...] = ()  # a seeded sample of the other passing tests: PASS_TO_PASS candidates


@dataclass(frozen=True, kw_only=True)
class _Kill:
    mutation: Mutation
    tests: tuple[str, ...]  # passing tests that run the function
    failing: tuple[str, ...]  # those the mutant makes fail: FAIL_TO_PASS
    still_passing: tuple[str, ...]  # PASS_TO_PASS: the rest of the run, which the mutant left passing
    patch: str  # mutant -> original
    statement: str


def is_test_file(path: str) -> bool:
    """Test code is never mutated: test_*.py, *_test.py, conftest.py, or anything in a test(s) directory."""
    p = PurePosixPath(path)
    in_test_dir = any(part in ("test", "tests", "testing") for part in p.parts[:-1])
    return in_test_dir or p.name.startswith("test_") or p.name.endswith("_test.py") or p.name == "conftest.py"


def _read(path: Path) -> str | None:
    try:
        return path.read_bytes().decode()
    except UnicodeDecodeError:
        return None


def _coverage(baseline: ProbeRun) -> dict[FunctionKey, set[str]]:
    covered: dict[FunctionKey, set[str]] = defaultdict(set)
    for test_id in baseline.passed:
        for key in baseline.called.get(test_id, ()):
            covered[key].add(test_id)
    return covered


def _trial_order(mutations: list[Mutation], operators: list[str], rng: random.Random) -> tuple[Mutation, ...]:
    """The function's operators taken in turn, in the order given, each's mutants shuffled: its first
    tries span its kinds of bug instead of repeating the commonest."""
    by_op: dict[str, list[Mutation]] = defaultdict(list)
    for m in mutations:
        by_op[m.operator].append(m)
    ops = [op for op in operators if op in by_op]
    for op in ops:
        rng.shuffle(by_op[op])
    rounds = max(len(v) for v in by_op.values())
    return tuple(by_op[op][i] for i in range(rounds) for op in ops if i < len(by_op[op]))


def _covered_functions(
    checkout: Path, covered: dict[FunctionKey, set[str]], cfg: GenerateConfig
) -> list[_Candidate]:
    """Functions outside the tests that passing tests run and that have mutants (in source order)."""
    found: list[_Candidate] = []
    for path in sorted({path for path, _ in covered if path.endswith(".py") and not is_test_file(path)}):
        source = _read(checkout / path)
        try:
            tree = ast.parse(source) if source is not None else None
        except SyntaxError:
            tree = None
        if source is None or tree is None:
            continue
        for fn in find_functions(tree, path):
            tests = covered.get((path, fn.first_line))
            mutations = tuple(mutate_function(source, fn, cfg.operators)) if tests else ()
            if tests and mutations:
                found.append(
                    _Candidate(
                        path=path,
                        function=fn.qualname,
                        original=source,
                        mutations=mutations,
                        tests=tuple(sorted(tests)),
                    )
                )
    return found


def _candidates(
    checkout: Path, covered: dict[FunctionKey, set[str]], passing: list[str], cfg: GenerateConfig
) -> list[_Candidate]:
    """The covered functions in a seeded order, each with its mutants in trial order. Each function
    starts with the operator it has that fewest functions before it started with (ties: a seeded
    rotation), so the first tries, which make most tasks, spread over every operator."""
    rng = random.Random(cfg.seed)
    found = _covered_functions(checkout, covered, cfg)
    rng.shuffle(found)
    rotation = list(cfg.operators)
    rng.shuffle(rotation)
    first: Counter = Counter()
    ordered = []
    for cand in found:
        ops = sorted({m.operator for m in cand.mutations}, key=lambda op: (first[op], rotation.index(op)))
        first[ops[0]] += 1
        others = [t for t in passing if t not in set(cand.tests)]
        if cfg.max_pass_to_pass:
            others = rng.sample(others, min(len(others), cfg.max_pass_to_pass))
        mutations = _trial_order(list(cand.mutations), ops, rng)
        ordered.append(dataclasses.replace(cand, mutations=mutations, others=tuple(others)))
    return ordered


@dataclass
class _Trial:
    kills: list[_Kill] = field(default_factory=list)
    outcomes: Counter = field(default_factory=Counter)
    run_s: list[float] = field(default_factory=list)


def _classify(
    cand: _Candidate, mutation: Mutation, probe: ProbeRun, cfg: GenerateConfig
) -> tuple[str, _Kill | None]:
    """killed (a task), survived, timeout, error (a test of the run has no outcome: the run broke),
    collateral (a test that does not run the function fails: the mutant breaks more than a
    function, e.g. the import machinery) or leaky (the statement would show a line of the fix)."""
    if probe.run.timed_out:
        return "timeout", None
    if any(t not in probe.outcomes for t in (*cand.tests, *cand.others)):
        return "error", None
    if any(probe.outcomes[t] != "passed" for t in cand.others):
        return "collateral", None
    failing = tuple(t for t in cand.tests if probe.outcomes[t] != "passed")
    if not failing:
        return "survived", None
    patch = unified_diff(mutation.path, mutation.source, cand.original)
    statement = problem_statement(failing, probe.failures, cfg.test_cmd)
    if leaks_fix(statement, patch):
        return "leaky", None
    still_passing = [t for t in cand.tests if t not in failing] + list(cand.others)
    if cfg.max_pass_to_pass:
        still_passing = still_passing[: cfg.max_pass_to_pass]
    kill = _Kill(
        mutation=mutation,
        tests=cand.tests,
        failing=failing,
        still_passing=tuple(sorted(still_passing)),
        patch=patch,
        statement=statement,
    )
    return "killed", kill


def _try(cand: _Candidate, runner: TestRunner, checkout: Path, cfg: GenerateConfig) -> _Trial:
    """Mutants of one function, in order, until enough make tests fail (or the tries run out)."""
    trial = _Trial()
    target = checkout / cand.path
    for mutation in cand.mutations[: cfg.max_tries_per_function]:
        target.write_bytes(mutation.source.encode())
        try:
            probe = runner.probe(checkout, [*cand.tests, *cand.others], timeout_s=cfg.timeout_s)
        finally:
            target.write_bytes(cand.original.encode())
        trial.run_s.append(probe.run.wall_s)
        outcome, kill = _classify(cand, mutation, probe, cfg)
        trial.outcomes[outcome] += 1
        if kill is not None:
            trial.kills.append(kill)
            if len(trial.kills) >= cfg.max_per_function:
                break
    return trial


def _search(
    candidates: list[_Candidate],
    checkouts: list[Path],
    runner: TestRunner,
    cfg: GenerateConfig,
    stats: GenerateStats,
    log: Log,
) -> list[_Kill]:
    """Candidates in order, `jobs` at a time, until `max_tasks` kills; the same kills for any `jobs`."""
    kills: list[_Kill] = []
    with ThreadPoolExecutor(max_workers=len(checkouts)) as pool:
        for start in range(0, len(candidates), len(checkouts)):
            chunk = candidates[start : start + len(checkouts)]
            trials = pool.map(lambda pair: _try(pair[0], runner, pair[1], cfg), zip(chunk, checkouts))
            for cand, trial in zip(chunk, trials):
                kills.extend(trial.kills)
                stats.outcomes.update(trial.outcomes)
                stats.mutant_run_s.extend(trial.run_s)
                verdict = ", ".join(
                    f"{k.mutation.operator} breaks {len(k.failing)} test(s)" for k in trial.kills
                )
                log(
                    f"[{min(len(kills), cfg.max_tasks):>3}/{cfg.max_tasks} tasks] "
                    f"{cand.path}::{cand.function}: "
                    f"{verdict or f'none of {sum(trial.outcomes.values())} mutant(s) kept'}"
                )
            if len(kills) >= cfg.max_tasks:
                break
    return kills[: cfg.max_tasks]


def _instance_id(name: str, m: Mutation, patch: str) -> str:
    module = m.path.removesuffix(".py").replace("/", ".")
    digest = hashlib.sha1(patch.encode()).hexdigest()[:6]
    return re.sub(r"[^A-Za-z0-9._-]", "_", f"{name}__{module}.{m.function}__{m.operator}__{digest}")


def _make_task(kill: _Kill, store: Path, tree: str, cfg: GenerateConfig) -> SweTask:
    m = kill.mutation
    instance_id = _instance_id(cfg.name, m, kill.patch)
    commit = build_task_repo(cfg.repo_out / instance_id, store, tree, kill.patch)
    return SweTask(
        instance_id=instance_id,
        repo=(cfg.repo_out / instance_id).absolute(),
        base_commit=commit,
        problem_statement=kill.statement,
        patch=kill.patch,
        fail_to_pass=kill.failing,
        pass_to_pass=kill.still_passing,
        test_cmd=cfg.test_cmd,
        mutation={"file": m.path, "function": m.function, "line": m.lineno, "operator": m.operator},
    )


def _baseline(
    runner: TestRunner, checkout: Path, cfg: GenerateConfig, stats: GenerateStats, log: Log
) -> ProbeRun:
    log(f"running the test suite of {cfg.repo} (traced) ...")
    baseline = runner.probe(checkout, [], trace=True, timeout_s=cfg.baseline_timeout_s)
    stats.num_tests, stats.num_passing = len(baseline.outcomes), len(baseline.passed)
    stats.baseline_s = baseline.run.wall_s
    if baseline.run.timed_out:
        raise GenerateError(
            f"the test suite ran past {cfg.baseline_timeout_s:.0f} s; raise --baseline-timeout-s"
        )
    if not baseline.passed:
        raise GenerateError(
            f"no test passed in {cfg.repo} with {cfg.test_cmd!r} (exit {baseline.run.returncode}); "
            f"the output ends with:\n{baseline.run.output[-2000:]}"
        )
    log(f"{stats.num_passing} of {stats.num_tests} tests pass ({stats.baseline_s:.1f} s)")
    return baseline


def generate(cfg: GenerateConfig, log: Log = print) -> tuple[list[SweTask], GenerateStats]:
    """Make up to `cfg.max_tasks` tasks; their repositories are written under `cfg.repo_out`."""
    cfg.check()
    stats, t0 = GenerateStats(), time.monotonic()
    runner = TestRunner(cfg.test_cmd, timeout_s=cfg.timeout_s)
    with tempfile.TemporaryDirectory(prefix="asyncrl-swe-tasks-") as tmp:
        work = Path(tmp)
        tree = snapshot(cfg.repo.resolve(), work / "store")
        checkouts = [work / f"checkout{j}" for j in range(cfg.jobs)]
        for c in checkouts:
            export_tree(work / "store", tree, c)
        try:
            baseline = _baseline(runner, checkouts[0], cfg, stats, log)
            candidates = _candidates(checkouts[0], _coverage(baseline), sorted(baseline.passed), cfg)
            stats.num_functions = len(candidates)
            stats.num_mutants = sum(len(c.mutations) for c in candidates)
            log(f"{stats.num_functions} covered functions, {stats.num_mutants} mutants")
            kills = _search(candidates, checkouts, runner, cfg, stats, log)
        finally:
            runner.close()
        cfg.repo_out.mkdir(parents=True, exist_ok=True)
        tasks = [_make_task(kill, work / "store", tree, cfg) for kill in kills]
    stats.wall_s = time.monotonic() - t0
    return tasks, stats
