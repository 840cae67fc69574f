"""Read a Hugging Face checkpoint by our tensor names, whole or one slice at a time.

Opening an `HFReader` reads only the safetensors headers. It maps each of our names (stacked
experts; MTP layers kept verbatim under `mtp.`, see asyncrl.model.mtp) to the HF tensors it comes
from, and reads data on demand, so a rank of a sharded model reads just the slices it owns:

    with HFReader(path, args) as reader:
        reader.check({name: shape, ...}, where=str(path))   # every tensor present, shapes as expected
        gate = reader.read("model.layers.1.mlp.experts.gate_proj", torch.float32, (slice(2, 4),))
        reader.bytes_read                                     # bytes taken from the files so far

A slice of a stacked expert tensor [E, I, D] reads only its experts (per-expert tensors
`mlp.experts.{e}.gate_proj.weight` on disk, as on the Hub, or transformers' fused
`mlp.experts.gate_up_proj` [E, 2I, D] / `mlp.experts.down_proj` [E, D, I]). safetensors maps the
data is read with positioned reads (`asyncrl.model.safetensors_file`), never mapped, so a reader
holds in memory only the tensors it returns, and the bytes of other slices are never read. Every
HF tensor is read by `read_hf`, which also dequantises block-scale FP8 weights (`X.weight` in
float8_e4m3fn with `X.weight_scale_inv`, one fp32 scale per 128x128 block, as DeepSeek-V3's
checkpoints and asyncrl's FP8 publications store them): a slice reads only the scale blocks that
cover it, and the values come back in fp32 (then in the caller's dtype).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from asyncrl.model.args import ModelArgs, ModelConfigError
from asyncrl.model.fp8 import BLOCK
from asyncrl.model.mtp import PREFIX as MTP_PREFIX
from asyncrl.model.mtp import hf_name as mtp_hf_name
from asyncrl.model.mtp import is_mtp_key, our_name
from asyncrl.model.safetensors_file import DTYPES, SafetensorsError, SafetensorsFile
from asyncrl.model.serving import SCALE_SUFFIX, dequantize_blocks, is_fp8_scale

__all__ = ["HFReader", "HFTensor", "safetensors_files"]

_EXPERT_KEY = re.compile(
    r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$"
)
_FUSED_KEY = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_READ_ERRORS = (SafetensorsError, OSError)
Index = tuple[slice, ...]


@dataclass(frozen=True, kw_only=True)
class HFTensor:
    """One tensor of a safetensors file, as its header describes it."""

    name: str  # the HF name
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors' dtype name, e.g. "BF16"
    scale: HFTensor | None = None  # the block scales (`X.weight_scale_inv`) of an FP8 weight


@dataclass(frozen=True, kw_only=True)
class _Source:
    """How one of our tensors is made of HF tensors."""

    parts: tuple[HFTensor, ...]  # one tensor, or one per expert stacked on a new dim 0
    shape: tuple[int, ...]  # ours
    stacked: bool = False
    fused: bool = False  # one half of a fused gate_up_proj [E, 2I, D]
    dim1_offset: int = 0  # where that half starts on dim 1 (0 gate, I up)


def safetensors_files(path: Path) -> list[Path]:
    """The weight files of a directory: those its index names, else every *.safetensors."""
    if not path.is_dir():
        raise ModelConfigError(f"weights directory not found: {path}")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ModelConfigError(
                f"{index}: not a valid safetensors index ({type(e).__name__}: {e})"
            ) from None
        files = [path / name for name in names if isinstance(name, str)]
        outside = [f for f in files if f.resolve().parent != path.resolve()]
        if len(files) != len(names) or outside:
            raise ModelConfigError(f"{index}: weight_map must name files inside {path}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        extra = (
            " (PyTorch .bin checkpoints are not supported; convert to safetensors)"
            if list(path.glob("*.bin"))
            else ""
        )
        raise ModelConfigError(f"{path} holds no *.safetensors weights{extra}")
    return files


class HFReader:
    """Our tensors of an HF safetensors directory, read whole or by slice; see the module docstring."""

    def __init__(self, path: str | os.PathLike, args: ModelArgs) -> None:
        self.path, self.args = Path(path), args
        self.bytes_read = 0
        self._files: dict[Path, SafetensorsFile] = {}
        try:
            self._sources = _plan(_attach_scales(self._scan()), args, self.path)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> HFReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    @property
    def names(self) -> list[str]:
        return list(self._sources)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._sources[name].shape

    def mtp_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name -> shape of every MTP-layer tensor (asyncrl.model.mtp keeps them verbatim)."""
        return {mtp_hf_name(n): s.shape for n, s in self._sources.items() if n.startswith(MTP_PREFIX)}

    def check(self, expected: Mapping[str, Sequence[int]], where: str) -> None:
        """Raise ModelConfigError unless the checkpoint holds exactly `expected` (our name -> full shape).

        A tied LM head may or may not be on disk. A wrong shape names the file and the HF tensor.
        """
        ours = set(self._sources) - ({"lm_head.weight"} if self.args.tie_word_embeddings else set())
        missing, unexpected = sorted(set(expected) - ours), sorted(ours - set(expected))
        if missing:
            raise ModelConfigError(f"{where}: missing tensors {_few(missing)}")
        if unexpected:
            raise ModelConfigError(f"{where}: unexpected tensors {_few(unexpected)}")
        for name, shape in expected.items():
            src, want = self._sources[name], list(shape)
            for part in src.parts:
                if src.stacked:
                    part_want = want[1:]
                elif src.fused:
                    part_want = [want[0], 2 * want[1], *want[2:]]
                else:
                    part_want = want
                if list(part.shape) != part_want:
                    raise ModelConfigError(
                        f"{part.file}: tensor '{part.name}' has shape {list(part.shape)}, expected "
                        f"{part_want}"
                    )

    def read(self, name: str, dtype: torch.dtype, index: Sequence[slice] = ()) -> torch.Tensor:
        """Our tensor `name`, or the slice `index` of it (one slice per leading dim, step 1), as `dtype`."""
        src = self._sources[name]
        full = _normalise(src.shape, index, name)
        sizes = [s.stop - s.start for s in full]
        if 0 in sizes:
            return torch.empty(sizes, dtype=dtype)
        if src.stacked:
            out = torch.empty(sizes, dtype=dtype)
            for i, e in enumerate(range(full[0].start, full[0].stop)):
                out[i].copy_(self.read_hf(src.parts[e], full[1:]))
            return out
        if src.fused:
            d1 = full[1]
            full = (full[0], slice(d1.start + src.dim1_offset, d1.stop + src.dim1_offset), *full[2:])
        return self.read_hf(src.parts[0], full).to(dtype)

    def read_hf(self, part: HFTensor, index: Index) -> torch.Tensor:
        """The slice `index` of one HF tensor, as stored (FP8 with block scales: in fp32), the one
        place that reads file data."""
        t = self._read_stored(part, index)
        if part.scale is None:
            return t
        rows, cols = index
        first = (rows.start // BLOCK, cols.start // BLOCK)
        blocks = (slice(first[0], -(-rows.stop // BLOCK)), slice(first[1], -(-cols.stop // BLOCK)))
        scale = self._read_stored(part.scale, blocks)
        return dequantize_blocks(t, scale, (rows.start - first[0] * BLOCK, cols.start - first[1] * BLOCK))

    def _read_stored(self, part: HFTensor, index: Index) -> torch.Tensor:
        try:
            t = self._files[part.file].read(part.name, index)
        except _READ_ERRORS as e:
            raise ModelConfigError(
                f"{part.file}: cannot read tensor '{part.name}' ({type(e).__name__}: {e})"
            ) from None
        self.bytes_read += t.numel() * t.element_size()
        return t

    def _scan(self) -> dict[str, HFTensor]:
        """Every tensor's header entry; weights must be floating point, each name in one file."""
        tensors: dict[str, HFTensor] = {}
        for file in safetensors_files(self.path):
            try:
                f = self._files[file] = SafetensorsFile(file)
            except _READ_ERRORS as e:
                raise ModelConfigError(f"{file}: cannot read safetensors ({type(e).__name__}: {e})") from None
            for key, entry in f.entries.items():
                if entry.dtype not in DTYPES:
                    floating = entry.dtype.startswith(("F", "BF"))
                    why = f"not one of {sorted(DTYPES)}" if floating else "weights must be floating point"
                    raise ModelConfigError(f"{file}: tensor '{key}' has dtype {entry.dtype}; {why}")
                if key in tensors:
                    raise ModelConfigError(f"{file}: tensor '{key}' is also in {tensors[key].file}")
                tensors[key] = HFTensor(name=key, file=file, shape=entry.shape, dtype=entry.dtype)
        return tensors


def _attach_scales(tensors: dict[str, HFTensor]) -> dict[str, HFTensor]:
    """Each `X.weight_scale_inv` moved onto its FP8 `X.weight`; an FP8 tensor needs its 2-D block scales."""
    out = {k: t for k, t in tensors.items() if not is_fp8_scale(k)}
    for key, scale in tensors.items():
        if not is_fp8_scale(key):
            continue
        name = key.removesuffix(SCALE_SUFFIX)
        weight = out.get(name)
        if weight is None:
            raise ModelConfigError(f"{scale.file}: block scales '{key}' without their weight '{name}'")
        blocks = [-(-n // BLOCK) for n in weight.shape]
        if len(weight.shape) != 2 or list(scale.shape) != blocks:
            raise ModelConfigError(
                f"{scale.file}: block scales '{key}' of shape {list(scale.shape)} do not fit the weight's "
                f"shape {list(weight.shape)} in {BLOCK}x{BLOCK} blocks"
            )
        out[name] = replace(weight, scale=scale)
    for key, t in out.items():
        if t.dtype.startswith("F8_") and t.scale is None:
            raise ModelConfigError(
                f"{t.file}: FP8 tensor '{key}' has no block scales ('{key}{SCALE_SUFFIX}'); only block-scale "
                "FP8 checkpoints can be read"
            )
    return out


def _plan(tensors: dict[str, HFTensor], args: ModelArgs, path: Path) -> dict[str, _Source]:
    """Our name -> its HF parts: experts stacked, fused gate_up_proj halved, MTP kept verbatim."""
    out: dict[str, _Source] = {}
    per_expert: dict[tuple[str, str], dict[int, HFTensor]] = {}
    for key, t in tensors.items():
        if is_mtp_key(key, args):
            out[our_name(key)] = _Source(parts=(t,), shape=t.shape)
        elif m := _EXPERT_KEY.match(key):
            per_expert.setdefault((m[1], m[3]), {})[int(m[2])] = t
        elif (m := _FUSED_KEY.match(key)) and m[2] == "gate_up_proj":
            E, two_i, *rest = t.shape
            half = (E, two_i // 2, *rest)
            out[f"{m[1]}.gate_proj"] = _Source(parts=(t,), shape=half, fused=True)
            out[f"{m[1]}.up_proj"] = _Source(parts=(t,), shape=half, fused=True, dim1_offset=two_i // 2)
        elif m:
            out[f"{m[1]}.down_proj"] = _Source(parts=(t,), shape=t.shape)
        else:
            out[key] = _Source(parts=(t,), shape=t.shape)
    for (prefix, proj), experts in per_expert.items():
        missing = sorted(set(range(args.num_experts)) - set(experts))
        if missing:
            raise ModelConfigError(f"checkpoint is missing experts {missing} for {prefix}.*.{proj}.weight")
        extra = sorted(experts.keys() - set(range(args.num_experts)))
        if extra:
            names = [experts[e].name for e in extra]
            raise ModelConfigError(
                f"{path}: unexpected tensors {_few(names)} (the model has {args.num_experts} experts)"
            )
        parts = tuple(experts[e] for e in range(args.num_experts))
        out[f"{prefix}.{proj}"] = _Source(parts=parts, shape=(len(parts), *parts[0].shape), stacked=True)
    return out


def _normalise(shape: tuple[int, ...], index: Sequence[slice], name: str) -> Index:
    """One explicit [start, stop) slice per dim of `shape`."""
    assert len(index) <= len(shape), f"{name}: index {index} has more dims than shape {shape}"
    full = []
    for dim, n in enumerate(shape):
        s = index[dim] if dim < len(index) else slice(None)
        start, stop, step = s.indices(n)
        assert step == 1, f"{name}: slices must have step 1, got {s}"
        full.append(slice(start, max(start, stop)))
    return tuple(full)


def _few(names: list[str]) -> str:
    return f"{names[:8]}{' ...' if len(names) > 8 else ''}"
