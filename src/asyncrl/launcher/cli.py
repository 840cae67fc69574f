"""`asyncrl <command> ...`: one entry point for every process role and tool.

Run `asyncrl --help` for the list. Each command owns its own arguments; process roles take
config files and dotted overrides (`asyncrl trainer @ cfg.toml --optim.lr 1e-4`).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

# command -> ("module:function", one-line help). Modules are imported lazily so that
# `asyncrl --help` and torch-free commands start fast.
COMMANDS: dict[str, tuple[str, str]] = {
    "init-model": (
        "asyncrl.tools.init_model:main",
        "write a randomly initialised HF-format model + tokenizer",
    ),
    "trainer": (
        "asyncrl.trainer.main:main",
        "RL trainer: rollouts/step_n -> weights/step_n (torchrun-ready)",
    ),
    "orchestrator": ("asyncrl.orchestrator.main:main", "rollouts over HTTP -> RUN/rollouts/step_n (asyncio)"),
    "sft-data": (
        "asyncrl.tools.sft_export:main",
        "write an env's reference answers as SFT JSONL (optionally corrupted)",
    ),
    "eval": (
        "asyncrl.tools.engine_eval:main",
        "mean reward of a model on an env's eval tasks (in-process engine, no server)",
    ),
    "sft": ("asyncrl.trainer.sft:main", "supervised fine-tuning on chat / prompt-completion JSONL"),
    "rl": ("asyncrl.launcher.rl:main", "asynchronous RL: inference + orchestrator + trainer, supervised"),
    "plan": ("asyncrl.tools.plan:main", "per-GPU memory and step time of a trainer layout (FSDP/EP/CP)"),
    "slurm": ("asyncrl.launcher.slurm:main", "render (and submit) an sbatch job for a multi-node RL run"),
    "inference": (
        "asyncrl.inference.main:main",
        "serve a model: embedded engine, OpenAI-compatible HTTP API",
    ),
    "eval-env": (
        "asyncrl.tools.endpoint_eval:main",
        "evaluate an OpenAI-compatible endpoint on an environment",
    ),
    "report": ("asyncrl.tools.report:main", "PNG plots and one HTML page of a run's metrics (matplotlib)"),
    "swe-tasks": (
        "asyncrl.tools.swe_tasks.cli:main",
        "SWE-bench-form tasks from a Python repository by mutation (--verify checks them)",
    ),
}


# Commands configured only by `@ file.toml --dotted.key value`: `--help` prints the module's docstring
# and every key of the schema with its default and description (`asyncrl rl` and `asyncrl slurm`
# print theirs, section by section, themselves).
CONFIG_HELP: dict[str, str] = {
    "trainer": "asyncrl.config.trainer:RLTrainerConfig",
    "sft": "asyncrl.config.trainer:SFTConfig",
    "orchestrator": "asyncrl.config.orchestrator:OrchestratorConfig",
    "inference": "asyncrl.config.inference:InferenceConfig",
}


def _usage() -> str:
    width = max(len(c) for c in COMMANDS)
    rows = "\n".join(f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items())
    return (
        f"usage: asyncrl <command> [args...]\n\ncommands:\n{rows}\n\n"
        "`asyncrl <command> --help` lists its options with their defaults and descriptions."
    )


def _resolve(target: str) -> Callable[[list[str]], int | None]:
    module, func = target.split(":")
    return getattr(importlib.import_module(module), func)


def _module_docstring(module: str) -> str:
    """Read without importing: the trainer's module pulls in torch, which `--help` does not need."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    return ast.get_docstring(ast.parse(Path(spec.origin).read_text())) or ""


def config_command_help(name: str) -> str:
    """`asyncrl NAME --help` of a config-driven command: its docstring, then every key it takes."""
    from asyncrl.config.base import config_help

    target = COMMANDS[name][0].split(":")[0]
    module, cls = CONFIG_HELP[name].split(":")
    keys = config_help(getattr(importlib.import_module(module), cls))
    return (
        f"{_module_docstring(target)}\n\nKeys (TOML, or `--dotted.key value` on the command line; "
        f"`--a-b` = `--a_b`):\n\n{keys}"
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(name, list(COMMANDS), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        print(f"asyncrl: unknown command '{name}'{hint}\n\n{_usage()}", file=sys.stderr)
        return 2
    if name in CONFIG_HELP and any(a in ("-h", "--help") for a in rest):
        print(config_command_help(name))
        return 0
    return run_command(name, rest)


def run_command(name: str, argv: list[str]) -> int:
    """Run one command; a config mistake is one message naming the command, exit code 2, no traceback."""
    from asyncrl.config import ConfigError  # not at the top: `asyncrl --help` stays free of pydantic

    try:
        return int(_resolve(COMMANDS[name][0])(argv) or 0)
    except ConfigError as e:
        print(f"asyncrl {name}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
