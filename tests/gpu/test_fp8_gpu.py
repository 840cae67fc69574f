"""FP8 on CUDA: the scaled_mm path agrees with the exact emulation (skipped without a GPU).

Run on a Hopper (sm90+) machine: `pytest tests/gpu/test_fp8_gpu.py -m gpu`.
"""

from __future__ import annotations

import pytest
import torch

from asyncrl.model import Transformer, preset_args
from asyncrl.model.fp8 import apply_fp8, fp8_linear

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.skipif(not _hopper(), reason="blockwise FP8 scaled_mm needs compute capability 9.0+")
@pytest.mark.parametrize("shape", [(256, 512, 384), (1, 128, 128), (333, 1024, 256)])
def test_scaled_mm_matches_emulation(shape):
    N, K, out_dim = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(N, K, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = (torch.randn(out_dim, K, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
    emulated = fp8_linear(x, w, backend="emulated").float()
    kernel = fp8_linear(x, w, backend="scaled_mm").float()
    rel = float((kernel - emulated).norm() / emulated.norm())
    assert rel < 1e-2  # same quantized operands; the kernel rounds its output to bf16


def test_emulated_cuda_equals_emulated_cpu():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 256, generator=gen)
    w = torch.randn(128, 256, generator=gen)
    cpu = fp8_linear(x, w, backend="emulated")
    gpu = fp8_linear(x.cuda(), w.cuda(), backend="emulated").cpu()
    assert torch.allclose(gpu, cpu, rtol=1e-4, atol=1e-4)


def test_fp8_model_forward_and_backward_on_cuda():
    model = Transformer(preset_args("tiny-moe"))
    model.init_weights(0)
    model = model.cuda().to(torch.bfloat16)
    apply_fp8(model, backend="auto")
    ids = torch.randint(0, 256, (2, 64), device="cuda")
    out = model(ids)
    assert torch.isfinite(out.logits).all()
    out.logits.float().logsumexp(-1).mean().backward()
    grad = model.layers[0].self_attn.q_proj.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and float(grad.abs().sum()) > 0
