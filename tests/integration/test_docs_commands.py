"""The commands the docs tell a user to run, run as written, so that the docs cannot drift from the code.

Each page (README.md, examples/*/README.md, docs/**/*.md) runs in a scratch directory of its own that
links the repository's examples/, docs/, scripts/ and benchmarks/, with `asyncrl` and `python` being
this interpreter. Every ```bash block runs as one bash script (`set -e`), in page order; every
```console block runs its `$ ` lines, and the lines printed under each in the page must appear in
order in what the command prints (whatever its exit code: `asyncrl plan` exits 1 for a layout that
does not fit, which a page may show). The markers above a block (docs/contributing.md, "Commands in the
docs") skip it with a reason, shorten it, prepare what it assumes, or run it as a server.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from helpers import child_env, free_port

REPO = Path(__file__).resolve().parents[2]
LINKED = ("examples", "docs", "scripts", "benchmarks")
MARKER = re.compile(r"^<!-- docs-test: (\w+)(?: (.*?))? -->$")
FENCE = re.compile(r"^```(\w*)$")
KINDS = {"skip", "sub", "setup", "server", "run"}
RUN = {"bash", "console"}  # fences that run by default; ```python runs only when marked `run`
COMMAND_TIMEOUT_S = 240
SERVER_READY_S = 180


def _pages() -> list[Path]:
    pages = [REPO / "README.md", *sorted((REPO / "examples").glob("*/README.md"))]
    return pages + sorted((REPO / "docs").rglob("*.md"))


@dataclass
class Block:
    """One fenced block of a page, with the markers right above it."""

    where: str  # page:line of the opening fence
    lang: str
    text: str
    skip: str | None = None
    subs: list[tuple[str, str]] = field(default_factory=list)
    setup: list[str] = field(default_factory=list)
    server: str | None = None
    run: bool = False

    def mark(self, kind: str, arg: str) -> None:
        if kind == "skip":
            self.skip = arg
        elif kind == "sub":
            old, sep, new = arg.partition(" => ")
            assert sep, f"{self.where}: `sub` needs 'OLD => NEW', got {arg!r}"
            self.subs.append((old, new))
        elif kind == "setup":
            self.setup.append(arg)
        elif kind == "server":
            self.server = arg
        else:
            self.run = True

    def runs(self) -> bool:
        return self.skip is None and (self.lang in RUN or (self.lang == "python" and self.run))


def parse(page: Path) -> list[Block]:
    """The fenced blocks of `page`; a marker that is not right above a fence is an error."""
    lines, blocks, marks = page.read_text().splitlines(), [], []
    name = page.relative_to(REPO)
    i = 0
    while i < len(lines):
        if m := MARKER.match(lines[i]):
            assert m[1] in KINDS, f"{name}:{i + 1}: unknown marker {m[1]!r}; known: {sorted(KINDS)}"
            assert m[1] == "run" or m[2], f"{name}:{i + 1}: marker {m[1]!r} needs an argument"
            marks.append((m[1], m[2] or ""))
        elif fence := FENCE.match(lines[i]):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            block = Block(where=f"{name}:{i + 1}", lang=fence[1], text="\n".join(lines[i + 1 : end]))
            for kind, arg in marks:
                block.mark(kind, arg)
            blocks.append(block)
            marks, i = [], end
        else:
            assert not marks, f"{name}:{i}: a docs-test marker must sit right above a fenced block"
        i += 1
    return blocks


class Page:
    """A scratch directory where one page's blocks run in order; its servers stop with it."""

    def __init__(self, root: Path) -> None:
        self.root, self.port = root, str(free_port())
        self.servers: list[subprocess.Popen[bytes]] = []
        for name in LINKED:
            (root / name).symlink_to(REPO / name)
        bin_dir = root / ".bin"
        bin_dir.mkdir()
        for name, argv in (("asyncrl", [sys.executable, "-m", "asyncrl"]), ("python", [sys.executable])):
            shim = bin_dir / name
            shim.write_text(f'#!/bin/sh\nexec {shlex.join(argv)} "$@"\n')
            shim.chmod(0o755)
        self.env = child_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    def fill(self, text: str) -> str:
        return text.replace("{port}", self.port)

    def bash(self, script: str, where: str, *, must_succeed: bool = True) -> str:
        """Run `script`; what it prints (stdout and stderr, as a terminal shows them)."""
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script],
            cwd=self.root,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
            check=False,
        )
        ok = done.returncode == 0 or not must_succeed
        assert ok, f"{where}: exit {done.returncode}\n$ {script}\n{done.stdout[-4000:]}"
        return done.stdout

    def serve(self, script: str, url: str, where: str) -> None:
        """Start `script` in the background (its own process group) and wait until `url`/health answers."""
        log = self.root / f"server-{len(self.servers)}.log"
        with log.open("w") as out:
            proc = subprocess.Popen(
                ["bash", "-euo", "pipefail", "-c", script],
                cwd=self.root,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.servers.append(proc)
        deadline = time.monotonic() + SERVER_READY_S
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"{where}: the server exited ({proc.returncode}):\n{log.read_text()}"
            try:
                if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        pytest.fail(f"{where}: {url}/health did not answer in {SERVER_READY_S} s:\n{log.read_text()}")

    def close(self) -> None:
        for proc in self.servers:
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.servers:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)

    def run(self, block: Block) -> None:
        text = block.text
        for old, new in block.subs:
            assert old in text, f"{block.where}: `sub` text {old!r} is not in the block"
            text = text.replace(old, self.fill(new))
        for command in block.setup:
            self.bash(self.fill(command), f"{block.where} (setup)")
        if block.lang == "python":
            script = self.root / "block.py"
            script.write_text(text)
            self.bash(f"python {script}", block.where)
        elif block.lang == "console":
            for command, expected in console_steps(text):  # a transcript: its output is what counts
                printed = self.bash(command, block.where, must_succeed=False)
                check_printed(printed, expected, f"{block.where}: $ {command}")
        elif block.server:
            self.serve(text, self.fill(block.server), block.where)
        else:
            self.bash(text, block.where)


def console_steps(text: str) -> list[tuple[str, list[str]]]:
    """(command, the lines the page shows it printing) for each `$ ` line of a console block."""
    steps: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        elif steps and line.strip():
            steps[-1][1].append(line.rstrip())
    return steps


def check_printed(out: str, expected: list[str], where: str) -> None:
    printed = iter(line.rstrip() for line in out.splitlines())
    for line in expected:
        assert any(p == line for p in printed), f"{where}: the page shows {line!r}, not printed so:\n{out}"


@pytest.mark.slow  # a page with a server or a model takes 10-30 s (init-model, torch imports, start-up)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_the_commands_of_the_page_run(page, tmp_path):
    runner = Page(tmp_path)
    try:
        for block in parse(page):
            if block.runs():
                runner.run(block)
    finally:
        runner.close()


def test_every_skip_says_why_and_every_shell_block_is_run_or_skipped():
    blocks = [b for page in _pages() for b in parse(page)]
    assert all(b.skip is None or len(b.skip) > 10 for b in blocks)
    shell = [b for b in blocks if b.lang in RUN]
    assert len([b for b in shell if b.runs()]) >= 10, [b.where for b in shell if b.runs()]
    assert all(b.lang in RUN | {"python"} for b in blocks if b.run or b.server)
