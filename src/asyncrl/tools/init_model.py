"""`asyncrl init-model --preset tiny-moe --out DIR [--seed N]`: a random HF-format model + tokenizer.

The directory loads with `asyncrl.model.from_pretrained` and with transformers'
`AutoModelForCausalLM` / `AutoTokenizer`.

`--init-std S` sets the std of the normal init of every matrix (default 0.02).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from asyncrl.model import PRESETS, Transformer, preset_args, save_pretrained
from asyncrl.model.tokenizer import save_byte_tokenizer


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="asyncrl init-model", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny-moe", choices=sorted(PRESETS), help="model size and kind")
    p.add_argument("--out", required=True, type=Path, help="output directory (created)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="dtype of the saved weights"
    )
    p.add_argument(
        "--init-std",
        type=float,
        default=0.02,
        help="std of the normal init of every matrix; 0.02 suits wide models, a 128-wide model "
        "trains faster from ~0.06 (examples/reverse_text/README.md)",
    )
    p.add_argument("--force", action="store_true", help="overwrite a non-empty output directory")
    return p


def init_model(
    preset: str, out: Path, seed: int = 0, dtype: torch.dtype = torch.float32, std: float = 0.02
) -> Transformer:
    if not std > 0:
        raise ValueError(f"--init-std must be > 0, got {std}")
    model = Transformer(preset_args(preset))
    model.init_weights(seed=seed, std=std)
    model.to(dtype)
    save_pretrained(model, out)
    save_byte_tokenizer(out)
    return model


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()) and not args.force:
        raise SystemExit(f"asyncrl init-model: {args.out} is not empty (use --force to overwrite)")
    model = init_model(args.preset, args.out, args.seed, getattr(torch, args.dtype), args.init_std)
    a = model.args
    print(
        f"wrote {args.preset} to {args.out}: {a.num_params() / 1e6:.2f}M parameters "
        f"({a.num_params(active=True) / 1e6:.2f}M active), {a.num_hidden_layers} layers, "
        f"{a.num_experts} experts top-{a.num_experts_per_tok}, vocab {a.vocab_size}"
    )
    return 0
