"""`asyncrl sft-data`: write an environment's reference answers as SFT JSONL, some deliberately wrong.

    asyncrl sft-data --env reverse-text --num 2000 --out data/sft.jsonl --corrupt-prob 0.3 \
        --env-args '{"min_len": 3, "max_len": 6}'

Each line is `{"messages": prompt + reference completion}`, the chat form that
`asyncrl.trainer.sft_sources.JsonlSFTSource` reads (loss on the assistant turns). Tasks come from the
env's "train" split (`asyncrl.envs.base.iter_reference_examples`), so evaluation on "eval" tasks
stays held out.

`--corrupt-prob P` damages the final assistant message of a fraction P of the rows with one
character edit (swap two neighbours, drop one, duplicate one, or replace one). Imperfect
demonstrations give an SFT policy that makes mistakes, which RL can then correct: the demo in
examples/reverse_text starts from such a policy.
"""

from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path
from typing import Any

from asyncrl.envs.base import iter_reference_examples
from asyncrl.envs.registry import build_env
from asyncrl.tools.progress import progress_bar

__all__ = ["CORRUPTIONS", "corrupt_text", "main", "write_sft_data"]

CORRUPTIONS = ("swap", "drop", "duplicate", "replace")


class SFTDataArgsError(ValueError):
    """A `sft-data` argument is invalid; the message names the flag."""


def corrupt_text(text: str, rng: random.Random, alphabet: str = string.ascii_lowercase) -> str:
    """`text` with exactly one character edit, chosen at random; never returns `text` unchanged
    when an edit can change it (a one-character text can only be dropped, duplicated or replaced)."""
    if not text:
        return rng.choice(alphabet)
    kinds = [k for k in CORRUPTIONS if k != "swap" or len(set(text)) > 1]
    kind = rng.choice(kinds)
    if kind == "swap":
        # two distinct characters imply an adjacent distinct pair, so candidates is non-empty
        i = rng.choice([i for i in range(len(text) - 1) if text[i] != text[i + 1]])
        return text[:i] + text[i + 1] + text[i] + text[i + 2 :]
    i = rng.randrange(len(text))
    if kind == "drop":
        return text[:i] + text[i + 1 :]
    if kind == "duplicate":
        return text[: i + 1] + text[i:]
    return text[:i] + rng.choice([c for c in alphabet if c != text[i]] or ["?"]) + text[i + 1 :]


def _row(prompt: list[dict], completion: list[dict], tools: list[dict]) -> dict[str, Any]:
    row: dict[str, Any] = {"messages": [*prompt, *completion]}
    if tools:
        row["tools"] = tools
    return row


def write_sft_data(
    env_name: str,
    num: int,
    out: Path,
    *,
    corrupt_prob: float = 0.0,
    seed: int = 0,
    env_args: dict[str, Any] | None = None,
) -> dict[str, int]:
    """Write `num` rows to `out` (atomically); returns {"rows": .., "corrupted": ..}."""
    if num < 1:
        raise SFTDataArgsError(f"--num must be >= 1, got {num}")
    if not 0.0 <= corrupt_prob <= 1.0:
        raise SFTDataArgsError(f"--corrupt-prob must be in [0, 1], got {corrupt_prob}")
    env = build_env(env_name, env_args, seed=seed)
    alphabet = getattr(env, "alphabet", string.ascii_lowercase)
    rng = random.Random(seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    rows = corrupted = 0
    with tmp.open("w") as f, progress_bar(num, f"sft-data {env_name}", "row") as bar:
        for ex in iter_reference_examples(env, "train", num):
            completion = [dict(m) for m in ex.completion]
            if rng.random() < corrupt_prob and completion and completion[-1].get("role") == "assistant":
                completion[-1]["content"] = corrupt_text(
                    str(completion[-1].get("content", "")), rng, alphabet
                )
                corrupted += 1
            f.write(json.dumps(_row(ex.prompt, completion, ex.tools)) + "\n")
            rows += 1
            bar.update(1)
    tmp.replace(out)
    return {"rows": rows, "corrupted": corrupted}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="asyncrl sft-data", description=__doc__.splitlines()[0])
    p.add_argument("--env", required=True, help="registered environment name or 'package.module:factory'")
    p.add_argument("--num", required=True, type=int, help="rows to write (train-split tasks 0..num-1)")
    p.add_argument("--out", required=True, type=Path, help="output JSONL file (overwritten)")
    p.add_argument("--corrupt-prob", type=float, default=0.0, help="fraction of rows given one wrong edit")
    p.add_argument("--seed", type=int, default=0, help="env seed and corruption seed")
    p.add_argument("--env-args", default="{}", help="JSON object of env arguments, e.g. '{\"max_len\": 6}'")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        env_args = json.loads(args.env_args)
    except json.JSONDecodeError as e:
        raise SystemExit(f"asyncrl sft-data: --env-args is not valid JSON ({e})") from None
    if not isinstance(env_args, dict):
        raise SystemExit(f"asyncrl sft-data: --env-args must be a JSON object, got {args.env_args!r}")
    try:
        stats = write_sft_data(
            args.env, args.num, args.out, corrupt_prob=args.corrupt_prob, seed=args.seed, env_args=env_args
        )
    except ValueError as e:  # SFTDataArgsError, EnvConfigError: user mistakes
        raise SystemExit(f"asyncrl sft-data: {e}") from None
    print(f"wrote {stats['rows']} rows ({stats['corrupted']} corrupted) from {args.env} to {args.out}")
    return 0
