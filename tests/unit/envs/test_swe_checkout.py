"""Checkouts at a base commit: no history inside, pristine after a reset, test files restored, patches
applied."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from asyncrl.envs.builtin.swe.checkout import CheckoutError, GitCheckout, GitSource, git
from asyncrl.envs.builtin.swe.example import write_example


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    tasks = write_example(tmp_path_factory.mktemp("example"))
    rows = [json.loads(line) for line in tasks.read_text().splitlines()]
    return tasks.parent / "calclib", rows


def _tree(root) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def _at(repo, commit) -> dict[str, str]:
    names = git("ls-tree", "-r", "--name-only", commit, cwd=repo).split()
    return {n: git("show", f"{commit}:{n}", cwd=repo) for n in names}


def _checkout(example, tmp_path, row: int = 0):
    repo, rows = example
    source = GitSource.open(repo, import_dir=tmp_path / "imports")
    commit = source.resolve([rows[row]["base_commit"]])[rows[row]["base_commit"]]
    checkout = GitCheckout(source=source, commit=commit)
    work, private = tmp_path / "work", tmp_path / "private"
    work.mkdir()
    private.mkdir()
    checkout.create(work, private)
    return checkout, work, private


def test_create_checks_out_the_commit_without_its_history(example, tmp_path):
    checkout, work, _ = _checkout(example, tmp_path)
    assert _tree(work) == _at(example[0], checkout.commit)
    assert not (work / ".git").exists()
    assert "hi - 1" in (work / "calclib" / "ops.py").read_text()  # the planted bug, not main's code


def test_reset_is_pristine_whatever_the_agent_did(example, tmp_path):
    checkout, work, private = _checkout(example, tmp_path)
    pristine = _tree(work)
    outside = tmp_path / "outside"
    outside.mkdir()
    (work / "calclib" / "ops.py").write_text("broken")
    (work / "tests" / "test_ops.py").unlink()
    (work / "new_dir" / "deep").mkdir(parents=True)
    (work / "new_dir" / "deep" / "f.txt").write_text("x")
    (work / "build.log").write_text("x")
    (work / ".gitignore").write_text("*.log\n")  # ignored files go too
    shutil.rmtree(work / "tests")
    os.symlink(outside, work / "tests")  # a directory swapped for a link out of the tree
    os.chmod(work / "new_dir", 0)
    checkout.reset(work, private)
    assert _tree(work) == pristine
    assert not (work / "tests").is_symlink() and list(outside.iterdir()) == []  # nothing written through it


def test_restore_and_apply(example, tmp_path):
    repo, rows = example
    checkout, work, private = _checkout(example, tmp_path, row=1)
    (work / "tests" / "test_ops.py").write_text("def test_add():\n    pass\n")
    (work / "tests" / "conftest.py").write_text("x = 1\n")
    checkout.restore(work, private, ["tests/test_ops.py", "tests/conftest.py"])
    assert _tree(work) == _at(repo, checkout.commit)  # the edit is undone, the added file removed
    checkout.apply(work, private, rows[1]["test_patch"])
    assert "def test_mean_empty" in (work / "tests" / "test_ops.py").read_text()
    with pytest.raises(CheckoutError, match="git apply"):
        checkout.apply(work, private, rows[1]["test_patch"])  # already applied: git says why it cannot


def test_a_plain_directory_is_imported_once(example, tmp_path):
    plain = tmp_path / "plain"
    shutil.copytree(example[0], plain, ignore=shutil.ignore_patterns(".git"))
    source = GitSource.open(plain, import_dir=tmp_path / "imports")
    assert source.imported_commit is not None and source.resolve([""]) == {"": source.imported_commit}
    assert GitSource.open(plain, import_dir=tmp_path / "imports") == source
    with pytest.raises(CheckoutError, match="plain directory .* leave base_commit empty"):
        source.resolve(["abc123"])
    assert set(source.files(source.imported_commit)) == {
        "calclib/__init__.py",
        "calclib/ops.py",
        "tests/test_ops.py",
    }


def test_unknown_commits_and_missing_repositories_are_named(example, tmp_path):
    source = GitSource.open(example[0], import_dir=tmp_path)
    with pytest.raises(CheckoutError, match="has no commit 'deadbeef'"):
        source.resolve(["deadbeef"])
    with pytest.raises(CheckoutError, match="names no base_commit"):
        source.resolve([""])
    with pytest.raises(CheckoutError, match="does not exist"):
        GitSource.open(tmp_path / "nope", import_dir=tmp_path)


def test_a_linked_worktree_is_a_source(example, tmp_path):
    repo, rows = example
    linked = tmp_path / "linked"
    git("worktree", "add", "-q", "--detach", str(linked), rows[0]["base_commit"], cwd=repo)
    try:
        source = GitSource.open(linked, import_dir=tmp_path / "imports")
        assert source.git_dir == repo / ".git"
        commit = rows[1]["base_commit"]
        checkout = GitCheckout(source=source, commit=source.resolve([commit])[commit])
        (tmp_path / "work").mkdir()
        (tmp_path / "private").mkdir()
        checkout.create(tmp_path / "work", tmp_path / "private")
        assert _tree(tmp_path / "work") == _at(repo, commit)
    finally:
        git("worktree", "remove", "--force", str(linked), cwd=repo)
