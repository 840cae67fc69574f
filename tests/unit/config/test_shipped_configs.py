"""Every TOML the repository ships loads: the files under examples/ and docs/, and the ```toml
blocks of docs/*.md and the READMEs. A block may be a fragment (a table or two of a larger config):
it passes when one command's schema accepts every key it sets, required keys left out."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from asyncrl.config import InferenceConfig, RLTrainerConfig, SFTConfig
from asyncrl.config.base import format_validation_error
from asyncrl.config.orchestrator import OrchestratorConfig
from asyncrl.launcher.slurm import SlurmRLConfig

REPO = Path(__file__).parents[3]
SCHEMAS: list[type[BaseModel]] = [
    SlurmRLConfig,
    RLTrainerConfig,
    SFTConfig,
    OrchestratorConfig,
    InferenceConfig,
]
BLOCK = re.compile(r"^```toml\n(.*?)^```", re.DOTALL | re.MULTILINE)


def _tracked(*patterns: str) -> list[Path]:
    """The files git tracks that match `patterns`: what the repository ships, not what a set-up
    script generated beside it (the task repositories under examples/swe/repos/, for example)."""
    out = subprocess.run(
        ["git", "ls-files", "--", *patterns], cwd=REPO, capture_output=True, text=True, check=True
    )
    return sorted(REPO / line for line in out.stdout.splitlines())


def _shipped() -> list[tuple[str, str]]:
    """(where, TOML text) of every TOML file under examples/ and docs/, and every ```toml block."""
    files = _tracked("examples/*.toml", "docs/*.toml")
    found = [(str(p.relative_to(REPO)), p.read_text()) for p in files]
    pages = _tracked("docs/*.md", "README.md", "examples/*.md")
    for page in pages:
        text = page.read_text()
        for m in BLOCK.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            found.append((f"{page.relative_to(REPO)}:{line}", m.group(1)))
    return found


def _problems(cls: type[BaseModel], data: dict) -> list[str]:
    """What `cls` rejects in `data`, leaving out the required keys a fragment does not set."""
    try:
        cls.model_validate(data)
    except ValidationError as e:
        if any(err["type"] != "missing" for err in e.errors()):
            return [format_validation_error(cls, e)]
    return []


def test_the_repository_ships_toml_to_check():
    where = [w for w, _ in _shipped()]
    assert "examples/reverse_text/rl.toml" in where and "examples/reverse_text/sft.toml" in where
    assert any(w.startswith("docs/trainer.md:") for w in where)


@pytest.mark.parametrize(("where", "text"), _shipped(), ids=[w for w, _ in _shipped()])
def test_shipped_toml_loads(where, text):
    data = tomllib.loads(text)
    problems = {cls.__name__: _problems(cls, data) for cls in SCHEMAS}
    assert any(not p for p in problems.values()), f"{where}: no schema accepts it:\n" + "\n".join(
        f"{name}: {p[0]}" for name, p in problems.items()
    )
