"""Shared by the benchmark scripts: write one section of BENCHMARKS.md in place.

Run a script as `python benchmarks/<name>.py`: Python puts this folder on sys.path, so
`from report import write_section` resolves here.
"""

from __future__ import annotations

from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "BENCHMARKS.md"

__all__ = ["BENCHMARKS", "write_section"]


def write_section(title: str, body: str, path: Path = BENCHMARKS) -> None:
    """Replace the section headed `title` (a '## ' line, up to the next '## '), or append it.

    `body` is the whole section, starting with the `title` line itself.
    """
    if not body.startswith(title + "\n"):
        raise ValueError(f"section body must start with its title line {title!r}")
    text = (
        path.read_text()
        if path.exists()
        else "# Benchmarks\n\nNumbers from this repository's benchmark scripts.\n"
    )
    start = text.find(title + "\n")
    if start < 0:
        text = text.rstrip() + "\n\n" + body
    else:
        end = text.find("\n## ", start + len(title))
        text = text[:start] + body.rstrip("\n") + "\n" + ("\n" + text[end + 1 :] if end >= 0 else "")
    path.write_text(text)
