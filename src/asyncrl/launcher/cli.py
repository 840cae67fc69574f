"""`asyncrl <command> ...`: one entry point for every process role and tool.

Run `asyncrl --help` for the list. Each command owns its own arguments; process roles take
config files and dotted overrides (`asyncrl trainer @ cfg.toml --optim.lr 1e-4`).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

# command -> ("module:function", one-line help). Modules are imported lazily so that
# `asyncrl --help` and torch-free commands start fast.
COMMANDS: dict[str, tuple[str, str]] = {
    "init-model": (
        "asyncrl.launcher.init_model:main",
        "write a randomly initialised HF-format model + tokenizer",
    ),
    "trainer": ("asyncrl.trainer.rl:main", "RL trainer: rollouts/step_n -> weights/step_n (torchrun-ready)"),
    "orchestrator": ("asyncrl.orchestrator.main:main", "rollouts over HTTP -> RUN/rollouts/step_n (asyncio)"),
    "sft-data": (
        "asyncrl.launcher.sft_export:main",
        "write an env's reference answers as SFT JSONL (optionally corrupted)",
    ),
    "eval": (
        "asyncrl.launcher.engine_eval:main",
        "mean reward of a model on an env's eval tasks (in-process engine, no server)",
    ),
    "sft": ("asyncrl.trainer.sft:main", "supervised fine-tuning on chat / prompt-completion JSONL"),
    "rl": ("asyncrl.launcher.rl:main", "asynchronous RL: inference + orchestrator + trainer, supervised"),
    "plan": ("asyncrl.launcher.plan:main", "per-GPU memory and step time of a trainer layout (FSDP/EP/CP)"),
    "slurm": ("asyncrl.launcher.slurm:main", "render (and submit) an sbatch job for a multi-node RL run"),
    "inference": (
        "asyncrl.inference.main:main",
        "serve a model: embedded engine, OpenAI-compatible HTTP API",
    ),
    "eval-env": (
        "asyncrl.envs.endpoint_eval:main",
        "evaluate an OpenAI-compatible endpoint on an environment",
    ),
}


def _usage() -> str:
    width = max(len(c) for c in COMMANDS)
    rows = "\n".join(f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items())
    return (
        f"usage: asyncrl <command> [args...]\n\ncommands:\n{rows}\n\n`asyncrl <command> --help` for details."
    )


def _resolve(target: str) -> Callable[[list[str]], int | None]:
    module, func = target.split(":")
    return getattr(importlib.import_module(module), func)


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
    return int(_resolve(COMMANDS[name][0])(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
