"""Checkouts of a task's repository at its base commit: the `swe` env's `sandbox_pool.Workspace`.

    source = GitSource.open(Path("repos/mylib"), import_dir=run_dir / "sources")
    sha = source.resolve("3f2c1ab")                    # the full commit id (CheckoutError if absent)
    checkout = GitCheckout(source, sha)
    checkout.create(work, private)   # private/git shares the source's objects; work holds the commit's files
    checkout.reset(work, private)    # pristine again: `read-tree -u --reset` + `clean -ffdx`
    checkout.restore(work, private, ["tests/test_a.py"])   # as the commit has them (or removed)
    checkout.apply(work, private, task.test_patch)

The work tree has no `.git`: the git directory lives in `private/`, which the sandbox never sees,
so the model cannot read later history (for mutation tasks, the parent commit is the answer).
Objects are shared with the source repository through git's alternates, so a checkout writes only
the work tree and a small index. A plain directory is imported once into a repository under
`import_dir` (its files as they are, `.gitignore` respected), and its one commit is the base.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from asyncrl.envs.base import EnvConfigError

__all__ = ["CheckoutError", "GitCheckout", "GitSource", "git", "safe_relative"]

_GIT_ENV = {
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_TERMINAL_PROMPT": "0",
    "GIT_AUTHOR_NAME": "asyncrl",
    "GIT_AUTHOR_EMAIL": "asyncrl@localhost",
    "GIT_COMMITTER_NAME": "asyncrl",
    "GIT_COMMITTER_EMAIL": "asyncrl@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z",
}


class CheckoutError(EnvConfigError):
    """A repository, commit or patch of a task that git cannot use; the message has git's reason."""


def git(*args: str, cwd: Path | None = None, stdin: str | None = None, env: dict | None = None) -> str:
    """Run git with no user or system configuration; its stdout, or CheckoutError with its stderr."""
    cmd = ["git", "-c", "safe.directory=*", "-c", "core.autocrlf=false", *args]
    proc = subprocess.run(
        cmd,
        cwd=cwd,
        input=stdin,
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, **_GIT_ENV, **(env or {})},
    )
    if proc.returncode != 0:
        raise CheckoutError(f"git {' '.join(args[:3])}: {proc.stderr.strip()[-500:] or proc.returncode}")
    return proc.stdout


def safe_relative(path: str) -> str:
    """`path` if it is relative and stays inside the repository (no `..`), else CheckoutError."""
    if not path or os.path.isabs(path) or ".." in Path(path).parts:
        raise CheckoutError(f"path {path!r} must be relative to the repository root, without '..'")
    return path


@dataclass(frozen=True, kw_only=True)
class GitSource:
    """A repository to check tasks out of: its git directory, and whether it was imported from a plain one."""

    path: Path  # what the task row named
    git_dir: Path
    imported_commit: str | None = None  # the one commit of an imported plain directory

    @classmethod
    def open(cls, path: Path, *, import_dir: Path) -> GitSource:
        if not path.is_dir():
            raise CheckoutError(f"repository {path} does not exist or is not a directory")
        if (path / ".git").exists() or _is_bare(path):
            # the common directory: a linked worktree's own git directory holds no objects
            git_dir = Path(git("rev-parse", "--path-format=absolute", "--git-common-dir", cwd=path).strip())
            return cls(path=path, git_dir=git_dir)
        return _import(path, import_dir)

    @property
    def objects(self) -> Path:
        return self.git_dir / "objects"

    def resolve(self, commits: list[str]) -> dict[str, str]:
        """{commit as given: full id}; CheckoutError naming the first commit the repository lacks."""
        if self.imported_commit is not None:
            if any(commits):
                raise CheckoutError(
                    f"{self.path} is a plain directory (no .git), but a task names base_commit "
                    f"{next(c for c in commits if c)!r}; leave base_commit empty for a directory"
                )
            return dict.fromkeys(commits, self.imported_commit)
        wanted = sorted(set(commits))
        query = "".join(f"{c}^{{commit}}\n" for c in wanted)
        lines = git("cat-file", "--batch-check", stdin=query, env=self._env)
        found = {}
        for commit, line in zip(wanted, lines.splitlines(), strict=True):
            if not commit:
                raise CheckoutError(f"a task names no base_commit in git repository {self.path}")
            if line.endswith("missing") or " commit " not in line:
                raise CheckoutError(f"repository {self.path} has no commit {commit!r}")
            found[commit] = line.split()[0]
        return found

    def show(self, commit: str, path: str) -> str | None:
        """The text of `path` at `commit`, or None when the commit has no such file."""
        try:
            return git("show", f"{commit}:{path}", env=self._env)
        except CheckoutError:
            return None

    def files(self, commit: str) -> list[str]:
        return git("ls-tree", "-r", "-z", "--name-only", commit, env=self._env).split("\0")[:-1]

    @property
    def _env(self) -> dict[str, str]:
        return {"GIT_DIR": str(self.git_dir)}


def _is_bare(path: Path) -> bool:
    return (path / "HEAD").is_file() and (path / "objects").is_dir() and (path / "refs").is_dir()


def _import(path: Path, import_dir: Path) -> GitSource:
    """A bare repository under `import_dir` with one commit of `path`'s files."""
    resolved = path.resolve()
    git_dir = import_dir / hashlib.sha256(str(resolved).encode()).hexdigest()[:16]
    if not git_dir.is_dir():
        tmp = git_dir.with_suffix(".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        git("init", "-q", "--bare", str(tmp))
        env = {"GIT_DIR": str(tmp), "GIT_WORK_TREE": str(resolved)}
        git("add", "-A", ".", cwd=resolved, env=env)
        tree = git("write-tree", cwd=resolved, env=env).strip()
        commit = git("commit-tree", "-m", f"import of {resolved}", tree, cwd=resolved, env=env).strip()
        git("update-ref", "refs/heads/imported", commit, cwd=tmp)
        tmp.rename(git_dir)
    commit = git("rev-parse", "refs/heads/imported", cwd=git_dir).strip()
    return GitSource(path=path, git_dir=git_dir, imported_commit=commit)


@dataclass(frozen=True, kw_only=True)
class GitCheckout:
    """`source` at `commit`, as a sandbox pool workspace (see the module docstring)."""

    source: GitSource
    commit: str  # full id

    @property
    def key(self) -> str:
        return f"{self.source.git_dir}@{self.commit}"

    def _git(self, private: Path, work: Path, *args: str, stdin: str | None = None) -> str:
        env = {"GIT_DIR": str(private / "git"), "GIT_WORK_TREE": str(work)}
        return git(*args, cwd=work, stdin=stdin, env=env)

    def create(self, work: Path, private: Path) -> None:
        git("init", "-q", "--bare", "--template=", str(private / "git"))  # no sample hooks to copy
        (private / "git" / "objects" / "info").mkdir(exist_ok=True)
        (private / "git" / "objects" / "info" / "alternates").write_text(f"{self.source.objects}\n")
        self._git(private, work, "read-tree", "-u", "--reset", self.commit)

    def reset(self, work: Path, private: Path) -> None:
        self._git(private, work, "read-tree", "-u", "--reset", self.commit)
        self._git(private, work, "clean", "-q", "-ffdx")

    def restore(self, work: Path, private: Path, paths: list[str]) -> None:
        """Put `paths` back as the commit has them; remove those it does not have."""
        tracked = set(self.source.files(self.commit))
        keep = [p for p in paths if p in tracked]
        for chunk in range(0, len(keep), 500):
            self._git(private, work, "checkout", "-q", self.commit, "--", *keep[chunk : chunk + 500])
        for path in paths:
            if path not in tracked:
                target = work / safe_relative(path)
                if target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target)
                elif target.exists() or target.is_symlink():
                    target.unlink()

    def apply(self, work: Path, private: Path, patch: str) -> None:
        if patch.strip():
            self._git(private, work, "apply", "--whitespace=nowarn", "-", stdin=patch)
