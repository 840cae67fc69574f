"""Unified diffs as the `swe` env needs them: which files a patch touches, and its hunks as edits.

    files = parse_patch(task.patch)            # [FilePatch(old_path="a.py", new_path="a.py", hunks=[...])]
    touched_paths(task.test_patch)             # {"tests/test_a.py"}
    apply_hunks(text, files[0].hunks)          # the file's text after the patch
    hunk.old_text, hunk.new_text               # what a string-replace editor swaps

Handles what `git diff` writes for text files: modified, added (`--- /dev/null`), deleted
(`+++ /dev/null`) and renamed files, and "\\ No newline at end of file". Binary patches raise.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = ["FilePatch", "Hunk", "PatchError", "apply_hunks", "parse_patch", "touched_paths"]

_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_DEV_NULL = "/dev/null"


class PatchError(ValueError):
    """A patch this module cannot read or apply; the message says where."""


@dataclass(kw_only=True)
class Hunk:
    old_start: int  # 1-based first line of the old side (0 for an empty file)
    old_count: int  # line counts the header announces
    new_count: int
    old_lines: list[str] = field(default_factory=list)  # each with its line ending
    new_lines: list[str] = field(default_factory=list)

    @property
    def old_text(self) -> str:
        return "".join(self.old_lines)

    @property
    def new_text(self) -> str:
        return "".join(self.new_lines)


@dataclass(kw_only=True)
class FilePatch:
    old_path: str | None  # None: the file is created
    new_path: str | None  # None: the file is deleted
    hunks: list[Hunk] = field(default_factory=list)
    binary: bool = False

    @property
    def path(self) -> str:
        return self.new_path or self.old_path or ""


def _strip_prefix(name: str) -> str | None:
    name = name.split("\t")[0].strip()
    if name == _DEV_NULL:
        return None
    if name.startswith('"') and name.endswith('"'):
        raise PatchError(f"quoted file name {name} (unusual characters) is not supported")
    return name[2:] if name[:2] in ("a/", "b/") else name


def parse_patch(text: str) -> list[FilePatch]:
    """The file patches of a unified diff, in order."""
    files: list[FilePatch] = []
    current: FilePatch | None = None
    hunk: Hunk | None = None
    last: list[str] | None = None  # the side(s) the previous line went to, for "\ No newline"
    for number, line in enumerate(text.splitlines(keepends=True), start=1):
        if line.startswith("diff --git "):
            current, hunk = FilePatch(old_path=None, new_path=None), None
            files.append(current)
            parts = line.split()
            current.old_path, current.new_path = _strip_prefix(parts[2]), _strip_prefix(parts[3])
        elif line.startswith("--- ") and (hunk is None or _hunk_done(hunk)):
            if current is None or current.hunks:
                current = FilePatch(old_path=None, new_path=None)
                files.append(current)
            current.old_path, hunk = _strip_prefix(line[4:]), None
        elif line.startswith("+++ ") and current is not None and hunk is None:
            current.new_path = _strip_prefix(line[4:])
        elif line.startswith(("Binary files ", "GIT binary patch")) and current is not None:
            current.binary = True
        elif line.startswith("new file mode") and current is not None and hunk is None:
            current.old_path = None
        elif line.startswith("deleted file mode") and current is not None and hunk is None:
            current.new_path = None
        elif line.startswith("@@"):
            match = _HUNK_RE.match(line)
            if current is None or match is None:
                raise PatchError(f"patch line {number}: a hunk header outside a file or malformed: {line!r}")
            counts = (int(match[2]) if match[2] else 1, int(match[4]) if match[4] else 1)
            hunk = Hunk(old_start=int(match[1]), old_count=counts[0], new_count=counts[1])
            current.hunks.append(hunk)
        elif hunk is not None and line[:1] in (" ", "-", "+") and not _hunk_done(hunk):
            body = line[1:]
            last = [hunk.old_lines, hunk.new_lines] if line[0] == " " else []
            if line[0] != "+":
                hunk.old_lines.append(body)
                last = [hunk.old_lines] if line[0] == "-" else last
            if line[0] != "-":
                hunk.new_lines.append(body)
                last = [hunk.new_lines] if line[0] == "+" else last
        elif line.startswith("\\") and hunk is not None and last:
            for side in last:
                side[-1] = side[-1].rstrip("\r\n")
        elif hunk is not None and line in ("\n", "\r\n") and not _hunk_done(hunk):
            hunk.old_lines.append(line)  # an empty context line whose leading space was stripped
            hunk.new_lines.append(line)
    for f in files:
        if f.binary:
            raise PatchError(f"{f.path}: binary patches are not supported")
    return files


def _hunk_done(hunk: Hunk) -> bool:
    return len(hunk.old_lines) >= hunk.old_count and len(hunk.new_lines) >= hunk.new_count


def touched_paths(text: str) -> set[str]:
    """Every path a patch reads or writes (both names of a rename)."""
    return {p for f in parse_patch(text) for p in (f.old_path, f.new_path) if p}


def apply_hunks(text: str, hunks: list[Hunk], *, path: str = "file") -> str:
    """`text` with the hunks applied at their line numbers; PatchError when a hunk does not match."""
    lines = text.splitlines(keepends=True)
    offset = 0
    for hunk in hunks:
        start = max(hunk.old_start - 1, 0) + offset
        if lines[start : start + len(hunk.old_lines)] != hunk.old_lines:
            raise PatchError(f"{path}: the hunk at line {hunk.old_start} does not match the file")
        lines[start : start + len(hunk.old_lines)] = hunk.new_lines
        offset += len(hunk.new_lines) - len(hunk.old_lines)
    return "".join(lines)
