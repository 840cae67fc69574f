"""The matmuls of the engine's decode-sized steps on CPUs with AVX-512: a small C kernel
(cpu_matmul.c), built with the system's C compiler on first use (`asyncrl.cpu_build`), for
the MoE routers and experts and for the linears of decode steps.

At decode sizes each expert sees a few rows (64 sequences, top-2 over 8 experts: ~16 rows each),
and torch's path pays per op and per expert: the sort and copies of the token rows, oneDNN's
matmuls, which at a few rows run well below the machine's bf16 rate, and the SwiGLU and the
weighted sum as separate passes. `MoEKernel` does a whole layer's experts in one call: the rows are
read in place, gate and up come out of one pass with silu(gate) * up applied as they are stored,
down is scaled by the routing weight as it is stored, and each token's choices are summed; all on
torch's OpenMP threads. `LinearKernel` multiplies up to `MAX_LINEAR_ROWS` rows by a linear's weight
(a decode step's q/k/v/o, dense MLPs, lm_head): at a few rows oneDNN's cost per call dominates, and
up to 128 rows its packed matmuls were no faster than the kernel (AVX-512 BF16, no AMX). bf16
linears that torch computes in fp32 (weights too small for native bf16, `compute.cpu_upcast`: a
small model's projections) it takes at any number of rows, prefill chunks included: there the
alternative is two casts around an fp32 matmul (BENCHMARKS.md, "Small bf16 linears in prefill
chunks (CPU)"). `RouterKernel` does a softmax-then-top-k router's work (`moe.Router`: Qwen3-MoE's)
in one call: the fp32 logits, softmax, top-k and normalisation that torch runs as seven ops, plus
two casts in bf16, for up to `MAX_ROUTER_MACS` multiply-adds.

Results round where torch's path rounds (tests check them against it). The experts: in bf16 after
each op for weights large enough for native bf16, once at the end for those torch computes in fp32
(`asyncrl.model.compute.cpu_upcast`), which go through the fp32 kernel. A linear rounds once in
either case, so bf16 linears of any size go through the bf16 kernel. A router computes in fp32
as torch's does and rounds the weights once; of equal probabilities it takes the lower expert.
bf16 needs AVX-512 BF16, fp32 AVX-512 F/BW/VL.

Weights are copied once per version into the kernel's layout (`kept` on the weights, as oneDNN's
packed copies are): as much memory again as the weights it multiplies (a router reads its fp32
weight, or the fp32 copy that torch's path uses too). The engine sets the kernels on its model's
`Router`, `GroupedExperts` and `compute.Linear` modules (`cpu_matmul_kernel`, on by default). They
take calls outside autograd (a router's also only without replayed ids) of at most
`MAX_ROWS_PER_EXPERT` rows per expert on average, of at most `MAX_LINEAR_ROWS` rows (any number
for the small bf16 linears above) and of at most `MAX_ROUTER_MACS` multiply-adds, where they are
faster than torch's ops (benchmarks/profile_engine.py --compare-matmul-kernel,
--compare-router-kernel; BENCHMARKS.md), and leave larger ones to torch.

Shape legend: N tokens (rows), K choices per token, E experts, D model dim, H (I in the weights'
names) expert hidden dim, Ip: H rounded up to 16, Dp: D rounded up to 32; a linear's weight is
[P, C] (out, in).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from asyncrl.cpu_build import BUILD_ERRORS, Unavailable, build
from asyncrl.model.compute import cpu_upcast, kept
from asyncrl.model.moe import grouped_swiglu

__all__ = [
    "MAX_LINEAR_ROWS",
    "MAX_ROWS_PER_EXPERT",
    "Kernels",
    "LinearKernel",
    "MatmulBuild",
    "MoEKernel",
    "RouterKernel",
    "load",
]

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_matmul.c")
# Up to these many rows the kernels were at least as fast as oneDNN's packed matmuls (AVX-512 BF16,
# no AMX; linears at hidden size 512 in a one-off timing, and the decode step in BENCHMARKS.md).
MAX_ROWS_PER_EXPERT = 64  # on average over a layer's experts
MAX_LINEAR_ROWS = 128  # a decode step of 64 sequences and the prefill chunks joining it
# The router kernel takes a layer's routing while it has at most this many multiply-adds (rows x
# experts x model dim): tiny-moe's up to 2048 rows, moe-50m's up to 512, a router of 128 experts x
# 2048 up to 8. Its dot products are plain FMAs, so past that a wide router is faster in torch's
# matmul (one-off timing, 2-core EPYC, fp32, kernel / torch: 128 x 2048 at 8 rows 0.79x, at 16 rows
# 1.17x, at 64 rows 1.94x), while narrow ones would still gain (tiny-moe's at 4096 rows 0.30x).
MAX_ROUTER_MACS = 1 << 21
ROUTER_MAX_EXPERTS = 1024  # cpu_matmul.c
_DTYPE_BITS = {torch.float32: 1, torch.bfloat16: 2}  # asyncrl_matmul_dtypes()
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}  # of the C functions
_ERRORS = {1: "no memory for the kernel's scratch", 2: "an expert id outside [0, E)"}


@dataclass(frozen=True)
class Kernels:
    """The library's kernels and the dtypes they compute."""

    experts: MoEKernel
    linear: LinearKernel
    router: RouterKernel

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        return self.experts.dtypes  # one build: both kernels have the same


@dataclass(frozen=True)
class MatmulBuild:
    """The loaded kernels (None: not available) and a one-line note of how they came to be."""

    kernels: Kernels | None
    note: str


def _dtypes(lib: ctypes.CDLL) -> tuple[torch.dtype, ...]:
    lib.asyncrl_matmul_dtypes.restype = ctypes.c_int
    bits = lib.asyncrl_matmul_dtypes()
    return tuple(dt for dt, bit in _DTYPE_BITS.items() if bits & bit)


class _LibraryKernel:
    """One of the library's kernels: its C function per dtype the build computes (`<prefix>_f32`,
    `<prefix>_bf16`). One per process, as the library: a model copied with the modules it is set on
    keeps it, and a pickled one refers to the unpickling process's own (ctypes pointers neither copy
    nor pickle)."""

    which: str  # its field of `Kernels`

    def __init__(self, lib: ctypes.CDLL, prefix: str, argtypes: list, restype: type | None) -> None:
        self.dtypes = _dtypes(lib)
        self._fns = {}
        for dtype in self.dtypes:
            fn = getattr(lib, f"{prefix}_{_SUFFIX[dtype]}")
            fn.argtypes, fn.restype = argtypes, restype
            self._fns[dtype] = fn

    def __deepcopy__(self, memo: dict) -> _LibraryKernel:
        return self

    def __reduce__(self) -> tuple:
        return (_loaded, (self.which,))


class MoEKernel(_LibraryKernel):
    """`(x_ND, ids_NK, weights_NK, gate_EID, up_EID, down_EDI) -> out_ND`: SwiGLU experts, each token's
    outputs weighted and summed over its choices (as `GroupedExperts.forward`)."""

    which = "experts"

    def __init__(self, lib: ctypes.CDLL) -> None:
        argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 5
        super().__init__(lib, "asyncrl_moe", argtypes, ctypes.c_int)
        self._fp32_on_bf16 = None  # the fp32 experts on bf16 inputs, output rounded to bf16
        if torch.float32 in self.dtypes:
            self._fp32_on_bf16 = lib.asyncrl_moe_f32_bf16io
            self._fp32_on_bf16.argtypes, self._fp32_on_bf16.restype = argtypes, ctypes.c_int

    def takes(self, x_ND: torch.Tensor, num_experts: int, top_k: int) -> bool:
        """Whether the kernel computes this call (else the caller runs torch's path): a plain CPU
        tensor of a dtype it has, outside autograd, at most MAX_ROWS_PER_EXPERT rows per expert."""
        if type(x_ND) is not torch.Tensor or x_ND.device.type != "cpu" or x_ND.dtype not in self._fns:
            return False
        if torch.is_grad_enabled() or x_ND.dim() != 2 or x_ND.shape[0] == 0:
            return False
        if x_ND.dtype == torch.bfloat16 and x_ND.shape[1] % 2:
            return False  # bf16 inputs are read in pairs
        return x_ND.shape[0] * top_k <= MAX_ROWS_PER_EXPERT * num_experts

    def __call__(
        self,
        x_ND: torch.Tensor,
        ids_NK: torch.Tensor,
        weights_NK: torch.Tensor,
        gate_EID: torch.Tensor,
        up_EID: torch.Tensor,
        down_EDI: torch.Tensor,
    ) -> torch.Tensor:
        N, D = x_ND.shape
        E, H = gate_EID.shape[:2]
        if ids_NK.shape[0] != N or weights_NK.shape != ids_NK.shape:
            raise ValueError(
                f"ids {tuple(ids_NK.shape)} and weights {tuple(weights_NK.shape)} for {N} tokens"
            )
        if gate_EID.shape != (E, H, D) or up_EID.shape != (E, H, D) or down_EDI.shape != (E, D, H):
            raise ValueError(
                f"expert weights: gate {tuple(gate_EID.shape)}, up {tuple(up_EID.shape)}, "
                f"down {tuple(down_EDI.shape)} for model dim {D}"
            )
        # bf16 experts that torch would compute in fp32 (compute.cpu_upcast: too small for native bf16
        # to pay) go through the fp32 kernel, so that they round where torch's path does: once, at the
        # end. The kernel widens the bf16 inputs and rounds the output itself (no casts as torch ops).
        dtype = x_ND.dtype
        if dtype == torch.bfloat16 and cpu_upcast(x_ND, expert_numel=H * D):
            return self.run(x_ND, ids_NK, weights_NK, gate_EID, up_EID, down_EDI, torch.float32, bf16_io=True)
        return self.run(x_ND, ids_NK, weights_NK, gate_EID, up_EID, down_EDI, dtype)

    def run(
        self,
        x_ND: torch.Tensor,
        ids_NK: torch.Tensor,
        weights_NK: torch.Tensor,
        gate_EID: torch.Tensor,
        up_EID: torch.Tensor,
        down_EDI: torch.Tensor,
        dtype: torch.dtype,
        *,
        bf16_io: bool = False,
    ) -> torch.Tensor:
        """The kernel of `dtype` (one of `dtypes`) on inputs and weights cast to it; output in `dtype`.
        bf16_io (fp32 only): inputs, routing weights and output in bf16, widened and rounded in the
        kernel; the same values as casting them to fp32 and the output back."""
        N, D = x_ND.shape
        K, E = ids_NK.shape[1], gate_EID.shape[0]
        gate_up, down = kept(f"cpu_moe_{dtype}", lambda: pack_experts(gate_EID, up_EID, down_EDI, dtype),
                             gate_EID, up_EID, down_EDI)  # fmt: skip
        fn, io = self._fns[dtype], dtype
        if bf16_io:
            if dtype != torch.float32:  # the fp32 kernel, there whenever it is in `dtypes`
                raise ValueError(f"bf16_io is for the fp32 kernel, not {dtype}")
            fn, io = self._fp32_on_bf16, torch.bfloat16
        x = x_ND.to(io).contiguous()
        ids = ids_NK.to(torch.int64).contiguous()
        weights = weights_NK.to(io).contiguous()
        out = torch.empty(N, D, dtype=io)
        code = fn(
            x.data_ptr(), ids.data_ptr(), weights.data_ptr(), gate_up.data_ptr(), down.data_ptr(),
            out.data_ptr(), N, K, E, D, gate_up.shape[1] * 16,
        )  # fmt: skip
        if code:
            raise (MemoryError if code == 1 else ValueError)(f"MoE kernel: {_ERRORS.get(code, code)}")
        return out


class RouterKernel(_LibraryKernel):
    """`(x_ND, weight_ED, top_k, normalize) -> (ids_NK, weights_NK)`: a softmax-then-top-k router
    (`moe.Router`) in one call: logits in fp32 on the fp32 weight (bf16 inputs widened, exactly),
    softmax, the top k (of equal probabilities the lower expert first), divided by their sum when
    `normalize`; ids in int64, weights in x's dtype. Torch's path takes seven ops for it, and in bf16
    two more casts; only the order of the sums differs."""

    which = "router"

    def __init__(self, lib: ctypes.CDLL) -> None:
        argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4 + [ctypes.c_int]
        super().__init__(lib, "asyncrl_router", argtypes, ctypes.c_int)

    def takes(self, x_ND: torch.Tensor, weight_ED: torch.Tensor, top_k: int) -> bool:
        """Whether the kernel computes this call (else the caller runs torch's path): a plain 2-D
        CPU input of a dtype it has, a contiguous fp32 CPU weight, outside autograd, at most
        ROUTER_MAX_EXPERTS experts and MAX_ROUTER_MACS multiply-adds."""
        if type(x_ND) is not torch.Tensor or x_ND.device.type != "cpu" or x_ND.dtype not in self._fns:
            return False
        if weight_ED.dtype != torch.float32 or weight_ED.device.type != "cpu" or weight_ED.dim() != 2:
            return False
        if not weight_ED.is_contiguous():
            return False
        if torch.is_grad_enabled() or x_ND.dim() != 2 or x_ND.shape[0] == 0:
            return False
        E, D = weight_ED.shape
        if x_ND.shape[1] != D or not 1 <= top_k <= E or E > ROUTER_MAX_EXPERTS:
            return False
        return x_ND.shape[0] * E * D <= MAX_ROUTER_MACS

    def __call__(
        self, x_ND: torch.Tensor, weight_ED: torch.Tensor, top_k: int, normalize: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        (N, D), E = x_ND.shape, weight_ED.shape[0]
        if weight_ED.shape != (E, D) or not 1 <= top_k <= E or E > ROUTER_MAX_EXPERTS:
            raise ValueError(
                f"router of {tuple(weight_ED.shape)} (at most {ROUTER_MAX_EXPERTS} experts) for "
                f"model dim {D}, top {top_k}"
            )
        if weight_ED.dtype != torch.float32 or not weight_ED.is_contiguous():
            raise ValueError(f"router weight in {weight_ED.dtype}: the kernel reads a contiguous fp32 one")
        x = x_ND.contiguous()
        ids = torch.empty(N, top_k, dtype=torch.int64)
        weights = torch.empty(N, top_k, dtype=x.dtype)
        self._fns[x.dtype](
            x.data_ptr(), weight_ED.data_ptr(), ids.data_ptr(), weights.data_ptr(), N, D, E, top_k, normalize
        )  # its one error (E or K out of range) is checked above
        return ids, weights


def pack_experts(
    gate_EID: torch.Tensor, up_EID: torch.Tensor, down_EDI: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's layouts (cpu_matmul.c): gate_up [E, Ip/16, D/2, 32, 2] in bf16 or [E, Ip/16, D, 32]
    in fp32 (per 16 hidden units, 16 gate then 16 up columns); down [E, Dp/32, Ip/2, 32, 2] or
    [E, Dp/32, Ip, 32]. Padding is zeros."""
    E, H, D = gate_EID.shape
    Ip, Dp = -(-H // 16) * 16, -(-D // 32) * 32
    gate = F.pad(gate_EID.detach().to(dtype), (0, 0, 0, Ip - H)).view(E, Ip // 16, 16, D)
    up = F.pad(up_EID.detach().to(dtype), (0, 0, 0, Ip - H)).view(E, Ip // 16, 16, D)
    gate_up = torch.stack([gate, up], dim=2).view(E, Ip // 16, 32, D)  # [E, U, 32, D]
    down = F.pad(down_EDI.detach().to(dtype), (0, Ip - H, 0, Dp - D)).view(E, Dp // 32, 32, Ip)
    if dtype == torch.bfloat16:
        gate_up = gate_up.view(E, Ip // 16, 32, D // 2, 2).permute(0, 1, 3, 2, 4)
        down = down.view(E, Dp // 32, 32, Ip // 2, 2).permute(0, 1, 3, 2, 4)
    else:
        gate_up, down = gate_up.permute(0, 1, 3, 2), down.permute(0, 1, 3, 2)
    return gate_up.contiguous(), down.contiguous()


class LinearKernel(_LibraryKernel):
    """`(x, weight) -> x @ weight.T` for inputs of at most MAX_LINEAR_ROWS rows, or of any number in
    bf16 where torch would compute in fp32 (no bias)."""

    which = "linear"

    def __init__(self, lib: ctypes.CDLL) -> None:
        super().__init__(lib, "asyncrl_linear", [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3, None)

    def takes(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether the kernel computes this call (else the caller runs torch's): plain CPU tensors
        of one dtype it has, outside autograd, no bias, 1 to MAX_LINEAR_ROWS rows; more rows in bf16
        where torch's path would widen to fp32 (`cpu_upcast`: a weight too small for native bf16)."""
        if (
            bias is not None
            or type(x) is not torch.Tensor
            or type(weight) not in (torch.Tensor, torch.nn.Parameter)
        ):
            return False
        if x.device.type != "cpu" or x.dtype not in self._fns or weight.dtype != x.dtype or weight.dim() != 2:
            return False
        if torch.is_grad_enabled() or x.numel() == 0 or x.shape[-1] != weight.shape[1]:
            return False
        if x.dtype == torch.bfloat16 and x.shape[-1] % 2:
            return False  # bf16 inputs are read in pairs
        if x.numel() // x.shape[-1] <= MAX_LINEAR_ROWS:
            return True
        return x.dtype == torch.bfloat16 and cpu_upcast(x, linear_numel=weight.numel())

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # bf16 in the bf16 kernel, whatever the weight's size: its products of bf16 pairs are exact,
        # summed in fp32 and rounded once, as in torch's fp32 upcast of the linears too small for
        # native bf16 (compute.cpu_upcast). Only the order of the sum differs, and the casts and
        # the fp32 copy of the weight are saved.
        return self.run(x, weight, x.dtype)

    def run(self, x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The kernel of `dtype` (one of `dtypes`) on x and weight cast to it; output in `dtype`."""
        P, C = weight.shape
        if x.shape[-1] != C:
            raise ValueError(f"input of {x.shape[-1]} features for a weight of {C}")
        packed = kept(f"cpu_linear_{dtype}", lambda: pack_linear(weight, dtype), weight)
        x2 = x.reshape(-1, C).to(dtype).contiguous()
        y = torch.empty(x2.shape[0], P, dtype=dtype)
        self._fns[dtype](x2.data_ptr(), packed.data_ptr(), y.data_ptr(), x2.shape[0], C, P)
        return y.view(*x.shape[:-1], P)


def pack_linear(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The kernel's layout of a linear's weight [P, C]: [Pp/32, C/2, 32, 2] in bf16, [Pp/32, C, 32]
    in fp32 (Pp: P rounded up to 32; padding is zeros)."""
    P, C = weight.shape
    Pp = -(-P // 32) * 32
    w = F.pad(weight.detach().to(dtype), (0, 0, 0, Pp - P)).view(Pp // 32, 32, C)
    if dtype == torch.bfloat16:
        return w.view(Pp // 32, 32, C // 2, 2).permute(0, 2, 1, 3).contiguous()
    return w.permute(0, 2, 1).contiguous()


@functools.cache
def load() -> MatmulBuild:
    """Build (or find built) and load the kernels, once per process."""
    try:
        lib = ctypes.CDLL(str(build(_SOURCE, "CPU matmul kernels")))
        kernels = Kernels(experts=MoEKernel(lib), linear=LinearKernel(lib), router=RouterKernel(lib))
        if not kernels.dtypes:
            raise Unavailable("this CPU has no AVX-512")
        _self_check(kernels)
    except Unavailable as e:
        log.info("CPU matmul kernels not used: %s", e)
        return MatmulBuild(None, f"decode matmuls torch ({e})")
    except BUILD_ERRORS as e:
        log.warning("CPU matmul kernels not used (torch's instead): %s", e)
        return MatmulBuild(None, f"decode matmuls torch (kernels failed: {e})")
    names = "/".join({torch.float32: "fp32", torch.bfloat16: "bf16"}[dt] for dt in kernels.dtypes)
    return MatmulBuild(
        kernels,
        f"decode matmuls C kernels (MoE routers and experts, linears of <= {MAX_LINEAR_ROWS} rows"
        + (
            ", bf16 ones too small for native bf16 at any row count"
            if torch.bfloat16 in kernels.dtypes
            else ""
        )
        + f"; {names})",
    )


def _loaded(which: str) -> _LibraryKernel | None:
    """This process's kernel `which` ("experts" or "linear"); None where it has none."""
    kernels = load().kernels
    return None if kernels is None else getattr(kernels, which)


def _self_check(kernels: Kernels) -> None:
    """The kernels against torch on a small case with odd sizes (H, D and a linear's output not
    multiples of the kernel's blocks, an expert with no tokens), in each dtype they have."""
    g = torch.Generator().manual_seed(0)
    N, K, E, D, H = 9, 2, 5, 34, 20
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(N)])  # expert E-1 idle
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        x = torch.randn(N, D, generator=g).to(dtype)
        weights = torch.rand(N, K, generator=g).to(dtype)
        gate, up = (torch.randn(E, H, D, generator=g).div(D**0.5).to(dtype) for _ in range(2))
        down = torch.randn(E, D, H, generator=g).div(H**0.5).to(dtype)
        router = torch.randn(E, D, generator=g)
        if dtype not in kernels.dtypes:
            continue
        with torch.no_grad():
            routed_ids, routed = kernels.router(x, router, K, True)
            want_routed, want_ids = F.softmax(F.linear(x.float(), router), dim=-1).topk(K, dim=-1)
            checks = {
                "MoE experts": (
                    kernels.experts.run(x, ids, weights, gate, up, down, dtype),
                    _reference(x, ids, weights, gate, up, down),
                ),
                "linear": (kernels.linear.run(x[:5], gate[0], dtype), x[:5] @ gate[0].T),
                "router weights": (routed, want_routed / want_routed.sum(dim=-1, keepdim=True)),
            }
        if not torch.equal(routed_ids, want_ids):
            raise RuntimeError(f"self-check: {dtype} router chose other experts than torch's")
        for what, (got, want) in checks.items():
            err = (got.float() - want.float()).abs().max().item()
            if not err <= tol:
                raise RuntimeError(f"self-check: {dtype} {what} differ from torch's by {err:.2e} (> {tol})")


def _reference(x, ids, weights, gate, up, down) -> torch.Tensor:
    """GroupedExperts.forward's arithmetic through the per-expert loop."""
    N, K = ids.shape
    order = ids.reshape(-1).argsort(stable=True)
    counts = torch.bincount(ids.reshape(-1), minlength=gate.shape[0])
    y = grouped_swiglu(x.index_select(0, order // K), counts, gate, up, down, linear=lambda a, w: a @ w.T)
    y_NKD = torch.empty_like(y).index_copy_(0, order, y)
    return (y_NKD.view(N, K, -1) * weights.unsqueeze(-1)).sum(dim=1)
