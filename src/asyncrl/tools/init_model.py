"""`asyncrl init-model --preset tiny-moe --out DIR [--seed N]`: a random HF-format model + tokenizer.

The directory loads with `asyncrl.model.from_pretrained` and with transformers'
`AutoModelForCausalLM` / `AutoTokenizer`.

`--init-std S` sets the std of the normal init of every matrix (default 0.02).

A preset with MTP layers (`num_nextn_predict_layers`, e.g. tiny-glm5) gets them random too, in
DeepSeek-V3 / GLM-5's checkpoint layout, so every path that must carry them has some to carry.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import torch

from asyncrl.model import PRESETS, Transformer, preset_args, save_pretrained
from asyncrl.model.hf import to_hf_tensors
from asyncrl.model.mtp import num_mtp_layers
from asyncrl.model.tokenizer import save_byte_tokenizer
from asyncrl.model.transformer import DecoderLayer


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
    for hf_key, tensor in random_mtp_tensors(model, seed, std).items():
        model.mtp.put(hf_key, tensor)
    model.to(dtype)
    save_pretrained(model, out)
    save_byte_tokenizer(out)
    return model


def random_mtp_tensors(model: Transformer, seed: int, std: float) -> dict[str, torch.Tensor]:
    """The MTP layers of `model.args`, by HF name: each a decoder layer (experts unstacked) plus
    enorm, hnorm, eh_proj [D, 2D], shared_head.norm, and shared_head.head / embed_tokens, which
    DeepSeek-V3 and GLM-5 checkpoints store as copies of the model's own."""
    args, out = model.args, {}
    gen = torch.Generator().manual_seed(seed + 1)
    for i in range(num_mtp_layers(args)):
        index = args.num_hidden_layers + i
        types = (*args.indexer_types, *["full"] * (i + 1)) if args.uses_dsa else ()
        layer = DecoderLayer(replace(args, num_hidden_layers=index + 1, indexer_types=types), index)
        D = args.hidden_size
        own = {
            "enorm.weight": torch.ones(D),
            "hnorm.weight": torch.ones(D),
            "eh_proj.weight": torch.randn(D, 2 * D, generator=gen) * std,
            "shared_head.norm.weight": torch.ones(D),
            "shared_head.head.weight": model.lm_head.weight.detach().clone(),
            "embed_tokens.weight": model.model.embed_tokens.weight.detach().clone(),
        }
        own |= {name: torch.zeros(b.shape) for name, b in layer.named_buffers()}
        for name, p in layer.named_parameters():  # the rule of Transformer.init_weights
            if name.endswith("norm.weight"):
                own[name] = torch.ones(p.shape)
            elif name.endswith(".bias"):
                own[name] = torch.zeros(p.shape)
            else:
                own[name] = torch.randn(p.shape, generator=gen) * std
        for name, t in own.items():
            out |= {k: v.clone() for k, v in to_hf_tensors(f"model.layers.{index}.{name}", t)}
    return out


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
