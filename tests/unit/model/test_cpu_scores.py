"""The CPU attention-score kernel (asyncrl.model.cpu_scores): fp32 products of bf16 operands against
fp64 on sizes that are not multiples of its blocks, strided rows and a prefix of the keys; its
packed layout; which operands it takes; the fp32 matmuls when it cannot be built."""

import shutil

import pytest
import torch

from asyncrl.model import cpu_scores

HAS_CC = any(shutil.which(c) for c in ("cc", "gcc", "clang"))


@pytest.fixture(scope="module")
def built():
    if not HAS_CC:
        pytest.skip("no C compiler on PATH: the blocked attention runs fp32 matmuls (tested below)")
    lib, note = cpu_scores.load()
    if lib is None and "no AVX-512 BF16" in note:
        pytest.skip(f"this CPU has no kernel: {note}")
    assert lib is not None, note
    assert note == "attention scores C kernel"


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def test_pack_keeps_each_pair_along_k_in_one_word():
    b = _bf16(2, 5, 6, seed=0)
    packed = cpu_scores.pack(b)
    assert packed.shape == (2, 3, 5, 2)
    for j in range(3):
        assert torch.equal(packed[:, j], b[:, :, 2 * j : 2 * j + 2])


@pytest.mark.parametrize(
    ("X", "M", "N", "n", "k"), [(1, 1, 1, 1, 2), (3, 17, 70, 70, 64), (2, 9, 40, 33, 10)]
)
def test_scores_are_fp32_products_of_the_bf16_values(built, X, M, N, n, k):
    a, b = _bf16(X, M, k, seed=1), _bf16(X, N, k, seed=2)
    got = cpu_scores.scores(a, cpu_scores.pack(b), n, 0.3)
    want = 0.3 * a.double() @ b[:, :n].double().transpose(1, 2)
    assert got.dtype == torch.float32 and got.shape == (X, M, n)
    # not rounded to bf16 (which would be ~4e-3): fp32 sums of exact products
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-6


def test_rows_of_a_larger_tensor_are_read_in_place(built):
    a_all, b = _bf16(2, 40, 16, seed=3), _bf16(2, 25, 16, seed=4)
    a = a_all[:, 7:30]  # a slice of rows: batch stride 40 rows, not 23
    assert not a.is_contiguous()
    got = cpu_scores.scores(a, cpu_scores.pack(b), 25, 1.0)
    assert torch.allclose(got, cpu_scores.scores(a.contiguous(), cpu_scores.pack(b), 25, 1.0), rtol=0, atol=0)
    assert torch.allclose(got, a.float() @ b.float().transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_supports_only_bf16_cpu_operands_of_even_head_dims(built):
    a, b = _bf16(1, 4, 8, seed=5), _bf16(1, 6, 8, seed=6)
    assert cpu_scores.supports(a, b)
    assert not cpu_scores.supports(a.float(), b.float())
    assert not cpu_scores.supports(a[..., :7], b[..., :7])
    assert not cpu_scores.supports(a.to("meta"), b.to("meta"))
    cpu_scores.set_enabled(False)
    try:
        assert not cpu_scores.supports(a, b) and not cpu_scores.available()
        assert cpu_scores.note() == "attention scores fp32 matmuls (kernel turned off)"
    finally:
        cpu_scores.set_enabled(True)


def test_no_compiler_means_fp32_matmuls_and_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("ASYNCRL_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setenv("CC", "no-such-compiler-asyncrl")
    cpu_scores.load.cache_clear()
    try:
        lib, note = cpu_scores.load()
        assert lib is None and not cpu_scores.available()
        assert note == "attention scores fp32 matmuls (CC='no-such-compiler-asyncrl' not found)"
        a = _bf16(1, 4, 8, seed=7)
        assert not cpu_scores.supports(a, a)
    finally:
        cpu_scores.load.cache_clear()
