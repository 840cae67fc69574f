"""Unified diffs: parsed hunks applied to the old files give exactly what git gives."""

from __future__ import annotations

import pytest

from asyncrl.envs.builtin.swe.checkout import git
from asyncrl.envs.builtin.swe.patch import PatchError, apply_hunks, parse_patch, touched_paths

OLD = {
    "a.py": "".join(f"line {i}\n" for i in range(1, 30)),
    "gone.py": "x = 1\n",
    "old_name.py": "def f():\n    return 1\n",
    "tail.txt": "no newline at the end",
    "blank.py": "a = 1\n\n\nb = 2\n",
}
NEW = {
    "a.py": OLD["a.py"].replace("line 3\n", "line three\n").replace("line 25\n", "line 25\nextra\n"),
    "new.py": "print('new')\n",
    "new_name.py": "def f():\n    return 1\n",
    "tail.txt": "no newline at the end, still",
    "blank.py": "a = 1\n\n\nb = 3\n",
}


def _diff(tmp_path) -> str:
    repo = tmp_path / "repo"
    repo.mkdir()
    git("init", "-q", cwd=repo)
    for files, message in ((OLD, "old"), (NEW, "new")):
        for p in repo.iterdir():
            if p.is_file():
                p.unlink()
        for name, text in files.items():
            (repo / name).write_text(text)
        git("add", "-A", cwd=repo)
        git("commit", "-q", "-m", message, cwd=repo)
    return git("diff", "-M", "HEAD~1", "HEAD", cwd=repo)


def test_parsed_hunks_reproduce_git(tmp_path):
    patch = _diff(tmp_path)
    files = {f.path: f for f in parse_patch(patch)}
    assert files["gone.py"].new_path is None and files["new.py"].old_path is None
    assert (files["new_name.py"].old_path, files["new_name.py"].new_path) == ("old_name.py", "new_name.py")
    assert touched_paths(patch) == set(OLD) | set(NEW)
    for path, f in files.items():
        if f.new_path is not None:
            old = OLD.get(f.old_path, "") if f.old_path else ""
            assert apply_hunks(old, f.hunks, path=path) == NEW[path], path
    assert len(files["a.py"].hunks) == 2
    assert (
        files["a.py"].hunks[0].old_text.count("line 3\n") == 1
        and "line three" in files["a.py"].hunks[0].new_text
    )


def test_a_hunk_that_does_not_match_is_an_error(tmp_path):
    (f,) = [f for f in parse_patch(_diff(tmp_path)) if f.path == "a.py"]
    with pytest.raises(PatchError, match="a.py: the hunk at line 1 does not match"):
        apply_hunks("something else\n", f.hunks, path="a.py")


def test_binary_and_malformed_patches_are_refused():
    binary = "diff --git a/x.png b/x.png\nindex 1..2 100644\nBinary files a/x.png and b/x.png differ\n"
    with pytest.raises(PatchError, match="binary patches are not supported"):
        parse_patch(binary)
    with pytest.raises(PatchError, match="malformed"):
        parse_patch("--- a/x\n+++ b/x\n@@ nonsense @@\n")
