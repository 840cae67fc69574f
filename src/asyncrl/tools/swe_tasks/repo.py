"""Git plumbing for task repositories, reproducible to the commit id.

Every git call runs without the user's and the system's git config and with a fixed author,
committer and date, so the same files give the same commit on any machine: that is how
`asyncrl swe-tasks --rebuild` recreates, from a freshly downloaded sdist, the exact `base_commit`s
a committed task file names.

A task's repository holds one commit, with no parent: the buggy state. Its history shows no fix,
and it holds no other task's files (each of which would contain this task's function unmutated).
"""

from __future__ import annotations

import difflib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from asyncrl.envs.builtin.swe.tasks import SweTask, SweTaskError

__all__ = [
    "GitError",
    "build_task_repo",
    "checkout",
    "export_tree",
    "is_git_repo",
    "rebuild_task_repos",
    "snapshot",
    "unified_diff",
]

_GIT_ENV = {
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_AUTHOR_NAME": "asyncrl swe-tasks",
    "GIT_AUTHOR_EMAIL": "swe-tasks@asyncrl.invalid",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000",
    "GIT_COMMITTER_NAME": "asyncrl swe-tasks",
    "GIT_COMMITTER_EMAIL": "swe-tasks@asyncrl.invalid",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
    "LC_ALL": "C",
}
_COMMIT_MESSAGE = "snapshot"  # says nothing about the bug: an agent may read the log


class GitError(RuntimeError):
    """A git command failed; the message has its arguments and stderr."""


def git(*args: str, cwd: Path | None = None, input: str | None = None, **env: str) -> str:
    """Run git with the fixed identity; stdout, or GitError."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")} | _GIT_ENV | env
    try:
        proc = subprocess.run(
            ["git", *args], cwd=cwd, input=input, capture_output=True, text=True, env=environ, check=False
        )
    except FileNotFoundError as e:
        if shutil.which("git") is None:
            raise GitError("git is not installed (or not on PATH): swe-tasks needs it") from None
        raise GitError(f"git {' '.join(args)}: {e}") from None
    if proc.returncode != 0:
        raise GitError(f"git {' '.join(args)} (in {cwd or os.getcwd()}): {proc.stderr.strip()}")
    return proc.stdout


def is_git_repo(path: Path) -> bool:
    """A repository of its own at `path` (a work tree's .git, or a bare repository), not merely a
    directory inside some other repository."""
    return (path / ".git").exists() or ((path / "HEAD").is_file() and (path / "objects").is_dir())


def snapshot(source: Path, store: Path) -> str:
    """The files of `source` (what its .gitignore leaves, never .git) as a tree in the repository
    `store` (created if missing); returns the tree id. `source` is only read."""
    if not (store / ".git").exists():
        git("init", "-q", str(store))
    with tempfile.TemporaryDirectory() as tmp:
        index = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        git(f"--git-dir={store / '.git'}", f"--work-tree={source}", "add", "-A", ".", cwd=source, **index)
        return git(f"--git-dir={store / '.git'}", "write-tree", **index).strip()


def export_tree(store: Path, tree: str, dest: Path) -> None:
    """Write the files of `tree` into the directory `dest` (created)."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        index = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        git(f"--git-dir={store / '.git'}", "read-tree", tree, **index)
        git(f"--git-dir={store / '.git'}", "checkout-index", "-a", "-f", f"--prefix={dest}/", **index)


def build_task_repo(dest: Path, store: Path, tree: str, patch: str) -> str:
    """A new repository at `dest` holding `tree` with `patch` reversed (the buggy state) as its one
    commit, checked out; returns the commit id. `dest` must not exist."""
    if dest.exists():
        raise FileExistsError(f"{dest} exists; remove it, or write the task repositories elsewhere")
    export_tree(store, tree, dest)
    try:
        git("init", "-q", "-b", "main", ".", cwd=dest)
        git("apply", "-R", "--whitespace=nowarn", "-", cwd=dest, input=patch)
        git("add", "-A", "-f", ".", cwd=dest)  # -f: exactly the exported files, whatever .gitignore says
        git("commit", "-q", "--no-verify", "-m", _COMMIT_MESSAGE, cwd=dest)
        return git("rev-parse", "HEAD", cwd=dest).strip()
    except GitError:
        shutil.rmtree(dest, ignore_errors=True)
        raise


def checkout(repo: Path, commit: str, dest: Path) -> None:
    """A copy of `repo` at `commit` in `dest` (a shared clone; a directory that is no repository
    is copied as it is, and `commit` is not checked)."""
    if not is_git_repo(repo):
        shutil.copytree(repo, dest, symlinks=True)
        return
    git("clone", "-q", "--shared", "--no-checkout", str(repo), str(dest))
    git("-c", "advice.detachedHead=false", "checkout", "-q", commit, cwd=dest)


def unified_diff(path: str, old: str, new: str) -> str:
    """A `git apply`-able diff of one file from `old` to `new` (a/ and b/ prefixes, 3 lines of context)."""
    lines = difflib.unified_diff(
        old.splitlines(keepends=True), new.splitlines(keepends=True), f"a/{path}", f"b/{path}"
    )
    return "".join(
        line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines
    )


def _head(repo: Path) -> str | None:
    try:
        return git("rev-parse", "HEAD", cwd=repo).strip() if is_git_repo(repo) else None
    except GitError:
        return None


def rebuild_task_repos(tasks: Sequence[SweTask], source: Path, *, log: Callable[[str], None] = print) -> int:
    """Recreate each row's repository from the original files at `source` and the row's patch,
    checking that the commit is the row's `base_commit`; returns how many were made (rows whose
    repository is already at its base_commit are left as they are)."""
    made = 0
    with tempfile.TemporaryDirectory(prefix="asyncrl-swe-rebuild-") as tmp:
        store = Path(tmp) / "store"
        tree = snapshot(source.resolve(), store)
        for task in tasks:
            dest = task.repo
            if _head(dest) == task.base_commit:
                continue
            if dest.exists():
                raise SweTaskError(f"{dest} exists but is not at {task.instance_id}'s base_commit: remove it")
            commit = build_task_repo(dest, store, tree, task.patch)
            if commit != task.base_commit:
                shutil.rmtree(dest, ignore_errors=True)
                raise SweTaskError(
                    f"{task.instance_id}: {source} with the row's patch reversed is commit {commit}, not "
                    f"{task.base_commit}: these are not the files the tasks were made from"
                )
            made += 1
    log(f"{made} task repositories made, {len(tasks) - made} already in place")
    return made
