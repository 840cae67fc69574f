"""What a process of a run imports before it does anything: torch and transformers cost seconds each.

`asyncrl rl` checks its config, the model directory's config.json and the parallel layout before it
imports either (the tokenizer check is the first to need transformers, and with it torch), and an
inference server that receives weights from files does not import the transfer machinery
(DTensor). The packages `asyncrl.model`, `asyncrl.distributed` and `asyncrl.weight_transfer` load
each exported name's module on first use (`asyncrl.lazy`).
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest

from helpers import child_env

HEAVY = ("torch", "transformers", "torch.distributed.tensor")


def imported_after(code: str) -> set[str]:
    """Which of HEAVY a fresh interpreter has imported after running `code`."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=child_env(), timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return set(json.loads(out.stdout.splitlines()[-1]))


def test_the_launcher_imports_neither_torch_nor_transformers():
    assert imported_after("import asyncrl.launcher.rl") == set()


def test_a_bad_model_directory_is_reported_before_torch_is_imported(tmp_path):
    bad = tmp_path / "model"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "qwen3_moe", "hidden_size": "wide"}')
    code = f"""
from asyncrl.launcher.cli import main
code = main(["rl", "--model", {str(bad)!r}, "--run-dir", {str(tmp_path / "run")!r}])
assert code == 2, code
"""
    assert imported_after(code) == set()


def test_a_server_without_distributed_weights_does_not_import_dtensor():
    assert "torch.distributed.tensor" not in imported_after("import asyncrl.inference.main")


@pytest.mark.parametrize("package", ["asyncrl.model", "asyncrl.distributed", "asyncrl.weight_transfer"])
def test_every_exported_name_resolves_and_an_unknown_one_is_an_attribute_error(package):
    module = importlib.import_module(package)
    for name in module.__all__:
        value = getattr(module, name)
        home = getattr(value, "__module__", None)  # classes and functions: defined in a submodule
        if home is not None and home.startswith(package):
            assert getattr(importlib.import_module(home), name) is value, name
        assert getattr(module, name) is value and name in vars(module), name  # kept after the first use
    assert set(module.__all__) <= set(dir(module))
    with pytest.raises(AttributeError, match=f"module '{package}' has no attribute 'nope'"):
        module.nope  # noqa: B018
