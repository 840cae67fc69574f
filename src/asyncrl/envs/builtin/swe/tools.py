"""The `swe` agent's tools: a shell, a file viewer, a string-replace editor, file creation, search, submit.

- `bash(command)`: a fresh `bash -c` in the repository (cd and variables do not persist), in the
  sandbox, under its limits; "exit code N" then stdout and stderr interleaved.
- `view(path, start_line, end_line)`: a file with line numbers (a 1-based inclusive range;
  end_line -1 = the end), or a directory two levels deep.
- `str_replace(path, old_str, new_str)`: replace the one occurrence of `old_str`; an error names the
  problem when it occurs 0 or several times.
- `create(path, content)`: write a whole file (created or overwritten).
- `search(pattern, path)`: a Python regular expression over the text files under `path`:
  `file:line: text`.
- `submit()`: end the episode; the tests then run on the repository as it is.

Paths are relative to the repository root or absolute under it (`/repo/...`). The file tools run
on the host on the sandbox's directory, and refuse paths that leave it (`..`, symlinks pointing out).
Long output is cut in the middle, with a marker saying how much (`cut_middle`). The text functions
(`view_text`, `replace_text`, `format_run`) are pure, so the env's reference solution predicts
every tool message exactly.
"""

from __future__ import annotations

import os
import re
from collections.abc import Awaitable, Callable
from pathlib import Path

from asyncrl.envs.sandbox import SandboxResult
from asyncrl.envs.tools import Tool, ToolError

__all__ = [
    "SUBMITTED",
    "created_message",
    "cut_middle",
    "format_run",
    "make_tools",
    "replace_text",
    "resolve_path",
    "search_tree",
    "view_text",
]

SUBMITTED = "Submitted. The tests now run on the repository as it is."
_MAX_LINE_CHARS = 300
_MAX_SEARCH_FILE_BYTES = 1 << 20
_SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".mypy_cache", ".tox", "node_modules", ".venv"}


def cut_middle(text: str, max_chars: int) -> str:
    """`text` when it fits; else its head and tail around a marker saying how many characters were cut."""
    if len(text) <= max_chars:
        return text
    keep = max(max_chars - 60, 2)
    head, tail = text[: keep // 2], text[len(text) - keep // 2 :]
    return f"{head}\n[... {len(text) - len(head) - len(tail)} characters cut ...]\n{tail}"


def format_run(result: SandboxResult, max_chars: int) -> str:
    """What `bash` answers: a status line, then the output (stderr is interleaved into stdout)."""
    if result.timed_out:
        status = f"killed: the command ran past its time limit ({result.wall_s:.0f} s)"
    elif result.output_truncated:
        status = "killed: the command wrote more output than the sandbox keeps"
    elif result.returncode is not None and result.returncode < 0:
        status = f"killed by signal {-result.returncode}"
    else:
        status = f"exit code {result.returncode}"
    output = result.stdout + result.stderr
    return f"{status}\n{cut_middle(output, max_chars)}" if output else status


def resolve_path(work: Path, path: str, mount_point: str) -> Path:
    """The host path of `path` (relative to the repository, or absolute under `mount_point`)."""
    if path == mount_point or path.startswith(mount_point + "/"):
        path = path[len(mount_point) :].lstrip("/") or "."
    elif os.path.isabs(path):
        raise ToolError(f"path {path!r} is outside the repository; use a path under {mount_point}")
    full = (work / path).resolve()
    if full != work and work not in full.parents:
        raise ToolError(f"path {path!r} leaves the repository ({mount_point})")
    return full


def _read_text(target: Path, path: str) -> str:
    if not target.exists():
        raise ToolError(f"{path} does not exist")
    if not target.is_file():
        raise ToolError(f"{path} is not a file")
    data = target.read_bytes()
    if b"\0" in data[:8192]:
        raise ToolError(f"{path} is a binary file")
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise ToolError(f"{path} is not UTF-8 text") from None


def _numbered(lines: list[str], first: int) -> str:
    return "".join(f"{first + i:6}\t{line[:_MAX_LINE_CHARS]}\n" for i, line in enumerate(lines))


def view_text(text: str, path: str, start_line: int | None, end_line: int | None, max_chars: int) -> str:
    """Lines start_line..end_line (1-based, inclusive; -1 = the end) of `text`, numbered."""
    lines = text.splitlines()
    if not lines:
        return f"{path} is empty"
    start = 1 if start_line is None else start_line
    end = len(lines) if end_line in (None, -1) else end_line
    if start < 1 or start > len(lines):
        raise ToolError(f"start_line {start} is outside {path}, which has {len(lines)} lines")
    if end < start:
        raise ToolError(f"end_line {end} is before start_line {start}")
    end = min(end, len(lines))
    shown = _numbered(lines[start - 1 : end], start)
    if len(shown) <= max_chars:
        return shown
    cut = shown[:max_chars].rsplit("\n", 1)[0]
    last = start + cut.count("\n")
    return f"{cut}\n[... lines {last + 1}-{end} not shown: view a smaller range with start_line/end_line]"


def _line_of(text: str, index: int) -> int:
    return text.count("\n", 0, index) + 1


def replace_text(text: str, path: str, old_str: str, new_str: str) -> tuple[str, str]:
    """(new text, message) for replacing the one occurrence of `old_str`; ToolError otherwise."""
    if not old_str:
        raise ToolError("old_str is empty; give the exact text to replace (use create to write a new file)")
    if old_str == new_str:
        raise ToolError("old_str and new_str are the same; nothing would change")
    starts = [m.start() for m in re.finditer(re.escape(old_str), text)]
    if not starts:
        raise ToolError(
            f"old_str was not found in {path}; it must match the file exactly, indentation and "
            "whitespace included (view the file to copy the text)"
        )
    if len(starts) > 1:
        lines = ", ".join(str(_line_of(text, s)) for s in starts[:10])
        raise ToolError(
            f"old_str occurs {len(starts)} times in {path} (at lines {lines}); include more of the "
            "surrounding lines so that it occurs once"
        )
    at = starts[0]
    new_text = text[:at] + new_str + text[at + len(old_str) :]
    first = _line_of(new_text, at)
    last = first + new_str.count("\n") - (1 if new_str.endswith("\n") else 0)
    lines = new_text.splitlines()
    lo, hi = max(first - 3, 0), min(max(last, first) + 2, len(lines))
    message = f"Edited {path}. Lines {lo + 1}-{hi} now read:\n{_numbered(lines[lo:hi], lo + 1)}"
    return new_text, message


def created_message(path: str, content: str, existed: bool) -> str:
    return f"{'Overwrote' if existed else 'Created'} {path} ({len(content.splitlines())} lines)"


def _tree(root: Path, work: Path, depth: int = 2) -> list[str]:
    entries = []
    for entry in sorted(root.iterdir()):
        if entry.name.startswith(".") or entry.name in _SKIP_DIRS:
            continue
        rel = str(entry.relative_to(work))
        is_dir = entry.is_dir() and not entry.is_symlink()
        entries.append(rel + ("/" if is_dir else ""))
        if is_dir and depth > 1:
            entries.extend(_tree(entry, work, depth - 1))
    return entries


def search_tree(work: Path, base: Path, pattern: str, max_matches: int) -> str:
    """`file:line: text` for every line matching `pattern` in the text files under `base`."""
    try:
        regex = re.compile(pattern)
    except re.error as e:
        raise ToolError(f"invalid regular expression {pattern!r}: {e}") from None
    files = [base] if base.is_file() else _text_files(base)
    hits: list[str] = []
    total = 0
    for file in files:
        try:
            text = file.read_bytes()[:_MAX_SEARCH_FILE_BYTES].decode(errors="replace")
        except OSError:
            continue
        for number, line in enumerate(text.splitlines(), start=1):
            if regex.search(line):
                total += 1
                if len(hits) < max_matches:
                    hits.append(f"{file.relative_to(work)}:{number}: {line.strip()[:_MAX_LINE_CHARS]}")
    if not hits:
        return f"no matches for {pattern!r}"
    more = f"\n[... {total - len(hits)} more matches not shown: narrow the pattern or the path]"
    return "\n".join(hits) + (more if total > len(hits) else "")


def _text_files(base: Path) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in sorted(filenames):
            path = Path(dirpath, name)
            try:
                with open(path, "rb") as f:
                    if b"\0" in f.read(8192):
                        continue
            except OSError:
                continue
            found.append(path)
    return found


def make_tools(
    *,
    work: Path,
    mount_point: str,
    run: Callable[[str], Awaitable[SandboxResult]],
    submit: Callable[[], None],
    max_chars: int,
    max_file_bytes: int,
) -> list[Tool]:
    """The six tools of one episode: `run` executes a bash command in its sandbox; `submit` ends it."""

    def where(path: str) -> Path:
        return resolve_path(work, path, mount_point)

    async def bash(command: str) -> str:
        """Run a bash command in the repository (a fresh shell each time: cd and variables do not persist)."""
        return format_run(await run(command), max_chars)

    def view(path: str, start_line: int | None = None, end_line: int | None = None) -> str:
        """Show a file with line numbers (start_line..end_line, 1-based, inclusive; -1 = to the end),
        or list a directory."""
        target = where(path)
        if target.is_dir():
            return cut_middle("\n".join(_tree(target, work)) or f"{path} is empty", max_chars)
        return view_text(_read_text(target, path), path, start_line, end_line, max_chars)

    def str_replace(path: str, old_str: str, new_str: str) -> str:
        """Replace old_str, which must occur exactly once in the file, with new_str."""
        target = where(path)
        new_text, message = replace_text(_read_text(target, path), path, old_str, new_str)
        target.write_text(new_text)
        return cut_middle(message, max_chars)

    def create(path: str, content: str) -> str:
        """Write a whole file: create it, or replace its content."""
        target = where(path)
        if len(content.encode()) > max_file_bytes:
            raise ToolError(
                f"content of {len(content.encode())} bytes is over the file size limit {max_file_bytes}"
            )
        if target.is_dir():
            raise ToolError(f"{path} is a directory")
        existed = target.exists()
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content)
        return created_message(path, content, existed)

    def search(pattern: str, path: str = ".") -> str:
        """Search the text files under path for a Python regular expression; prints file:line: text."""
        target = where(path)
        if not target.exists():
            raise ToolError(f"{path} does not exist")
        return cut_middle(search_tree(work, target, pattern, max_matches=100), max_chars)

    def submit_() -> str:
        """Submit the repository as it is and end the episode (the tests run then)."""
        submit()
        return SUBMITTED

    return [
        Tool.from_function(bash),
        Tool.from_function(view),
        Tool.from_function(str_replace),
        Tool.from_function(create),
        Tool.from_function(search),
        Tool.from_function(submit_, name="submit"),
    ]
