"""The swe agent's tools: bounded output, line ranges, replace errors that name the problem, paths."""

from __future__ import annotations

import asyncio
import os

import pytest

from asyncrl.envs.builtin.swe.tools import (
    SUBMITTED,
    cut_middle,
    format_run,
    make_tools,
    replace_text,
    resolve_path,
    search_tree,
    view_text,
)
from asyncrl.envs.sandbox import SandboxResult
from asyncrl.envs.tools import ToolCall, ToolError, call_tool

TEXT = "".join(f"row {i}\n" for i in range(1, 101))


def test_view_shows_numbered_line_ranges():
    assert view_text(TEXT, "f.py", 3, 4, 10_000) == "     3\trow 3\n     4\trow 4\n"
    assert view_text(TEXT, "f.py", 99, -1, 10_000).splitlines() == ["    99\trow 99", "   100\trow 100"]
    assert view_text(TEXT, "f.py", 99, 500, 10_000).count("\n") == 2  # end past the file: up to its end
    with pytest.raises(ToolError, match="start_line 101 is outside f.py, which has 100 lines"):
        view_text(TEXT, "f.py", 101, None, 10_000)
    with pytest.raises(ToolError, match="end_line 2 is before start_line 5"):
        view_text(TEXT, "f.py", 5, 2, 10_000)


def test_view_output_is_bounded_with_a_marker():
    shown = view_text(TEXT, "f.py", None, None, 200)
    assert len(shown) < 300 and shown.startswith("     1\trow 1\n")
    assert shown.endswith("not shown: view a smaller range with start_line/end_line]")
    last_shown = int(shown.splitlines()[-2].split("\t")[0])
    assert f"[... lines {last_shown + 1}-100 not shown" in shown


def test_replace_errors_name_the_problem():
    text = "a = 1\nb = 2\na = 1\n"
    with pytest.raises(ToolError, match=r"old_str was not found in m.py; it must match the file exactly"):
        replace_text(text, "m.py", "c = 3", "c = 4")
    with pytest.raises(ToolError, match=r"old_str occurs 2 times in m.py \(at lines 1, 3\)"):
        replace_text(text, "m.py", "a = 1", "a = 0")
    with pytest.raises(ToolError, match="old_str is empty"):
        replace_text(text, "m.py", "", "x")
    with pytest.raises(ToolError, match="old_str and new_str are the same"):
        replace_text(text, "m.py", "b = 2", "b = 2")
    new, message = replace_text(text, "m.py", "b = 2\n", "b = 20\nb2 = 0\n")
    assert new == "a = 1\nb = 20\nb2 = 0\na = 1\n"
    assert message.startswith("Edited m.py. Lines 1-4 now read:\n") and "     3\tb2 = 0" in message


def test_long_output_is_cut_in_the_middle_with_a_marker():
    text = "".join(f"{i:05}\n" for i in range(10_000))
    cut = cut_middle(text, 1000)
    assert len(cut) <= 1000 and cut.startswith("00000\n") and cut.endswith("09999\n")
    marker = next(line for line in cut.splitlines() if line.startswith("[..."))
    kept = len(cut) - len(marker) - 2
    assert marker == f"[... {len(text) - kept} characters cut ...]"
    assert cut_middle("short", 1000) == "short"


def test_format_run_says_how_the_command_ended():
    def run(**kw) -> SandboxResult:
        return SandboxResult(**({"returncode": 0, "stdout": "", "stderr": ""} | kw))

    assert format_run(run(stdout="hi\n"), 100) == "exit code 0\nhi\n"
    assert format_run(run(returncode=2), 100) == "exit code 2"
    assert format_run(run(returncode=-9, timed_out=True, wall_s=30.2), 100).startswith(
        "killed: the command ran past its time limit (30 s)"
    )
    assert format_run(run(returncode=-9, output_truncated=True), 100).startswith(
        "killed: the command wrote more"
    )


def test_paths_stay_inside_the_repository(tmp_path):
    work = tmp_path / "work"
    (work / "pkg").mkdir(parents=True)
    (tmp_path / "secret").write_text("x")
    os.symlink(tmp_path / "secret", work / "link")
    assert resolve_path(work, "/repo/pkg", "/repo") == work / "pkg"
    assert resolve_path(work, "/repo", "/repo") == work
    assert resolve_path(work, "pkg/../pkg", "/repo") == work / "pkg"
    with pytest.raises(ToolError, match="path '../secret' leaves the repository"):
        resolve_path(work, "../secret", "/repo")
    with pytest.raises(ToolError, match="path 'link' leaves the repository"):
        resolve_path(work, "link", "/repo")
    with pytest.raises(
        ToolError, match="path '/etc/passwd' is outside the repository; use a path under /repo"
    ):
        resolve_path(work, "/etc/passwd", "/repo")


def test_search_finds_lines_and_bounds_them(tmp_path):
    (tmp_path / "a.py").write_text("def add(a, b):\n    return a + b\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text("".join(f"x{i} = add(1, {i})\n" for i in range(5)))
    (tmp_path / "bin.dat").write_bytes(b"add\0\0")
    assert search_tree(tmp_path, tmp_path, r"def add", 10) == "a.py:1: def add(a, b):"
    hits = search_tree(tmp_path, tmp_path, r"add\(", 3)
    assert hits.splitlines()[:3] == [
        "a.py:1: def add(a, b):",
        "sub/b.py:1: x0 = add(1, 0)",
        "sub/b.py:2: x1 = add(1, 1)",
    ]
    assert hits.endswith("[... 3 more matches not shown: narrow the pattern or the path]")
    assert search_tree(tmp_path, tmp_path, "nothing here", 3) == "no matches for 'nothing here'"
    with pytest.raises(ToolError, match=r"invalid regular expression '\(': missing \)"):
        search_tree(tmp_path, tmp_path, "(", 3)


def test_file_tools_through_the_tool_protocol(tmp_path):
    submitted = []

    async def run(command: str) -> SandboxResult:
        raise AssertionError("no shell here")

    tools = {
        t.name: t
        for t in make_tools(
            work=tmp_path,
            mount_point="/repo",
            run=run,
            submit=lambda: submitted.append(1),
            max_chars=2000,
            max_file_bytes=100,
        )
    }
    assert set(tools) == {"bash", "view", "str_replace", "create", "search", "submit"}

    def call(name: str, **arguments) -> str:
        return asyncio.run(
            call_tool(tools, ToolCall(name=name, arguments=arguments), timeout_s=5, max_chars=4000)
        ).content

    assert call("create", path="pkg/m.py", content="x = 1\ny = 2\n") == "Created pkg/m.py (2 lines)"
    assert call("view", path="/repo/pkg/m.py", start_line=2) == "     2\ty = 2\n"
    assert call("view", path=".") == "pkg/\npkg/m.py"
    assert call("str_replace", path="pkg/m.py", old_str="y = 2", new_str="y = 3").startswith(
        "Edited pkg/m.py."
    )
    assert (tmp_path / "pkg" / "m.py").read_text() == "x = 1\ny = 3\n"
    assert call("str_replace", path="pkg/m.py", old_str="z", new_str="w").startswith(
        "error: old_str was not found"
    )
    assert call("view", path="nope.py") == "error: nope.py does not exist"
    assert call("create", path="big.py", content="x" * 101) == (
        "error: content of 101 bytes is over the file size limit 100"
    )
    assert call("search", pattern="y = ", path="pkg") == "pkg/m.py:2: y = 3"
    assert call("submit") == SUBMITTED and submitted == [1]
