"""The CPU decode attention kernel (asyncrl.inference.cpu_decode): SDPA's output on strided rows of
unequal lengths in fp32 and bf16, its input checks, the engine's tokens and logprobs against the
same engine on SDPA (over the dense rows and over the gathered blocks), its build cache, and SDPA
whenever it cannot be built."""

import copy
import shutil
import stat

import pytest
import torch
import torch.nn.functional as F
from inference_helpers import (
    assert_same_answers,
    drain,
    forget_kernel_loads,
    random_prompts,
    serve_greedy,
    worst_teacher_error,
)

from asyncrl.config.inference import InferenceConfig
from asyncrl.inference import Engine, SamplingOptions, cpu_decode
from asyncrl.inference.decode_kv import DecodeKV
from asyncrl.inference.kv_cache import AttentionPaths
from asyncrl.inference.main import _kernels_note
from asyncrl.model import Transformer, preset_args

HAS_CC = any(shutil.which(c) for c in ("cc", "gcc", "clang"))
needs_cc = pytest.mark.skipif(not HAS_CC, reason="no C compiler on PATH: the engine runs SDPA (tested below)")


@pytest.fixture
def kernel() -> cpu_decode.DecodeKernel:
    build = cpu_decode.load()
    assert build.kernel is not None, build.note
    return build.kernel


@pytest.fixture
def fresh_load(monkeypatch, tmp_path):
    """`load()` run anew, building into an empty cache; the process's cached result comes back after,
    and so do the other kernels' (an engine made meanwhile loads them, under this test's CC)."""
    monkeypatch.setenv("ASYNCRL_KERNEL_CACHE", str(tmp_path / "kernels"))
    cpu_decode.load.cache_clear()
    yield cpu_decode.load
    forget_kernel_loads()


def _reference(q, k, v, length_R):
    keep = (torch.arange(k.shape[2])[None, :] < length_R[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=keep)


@needs_cc
@pytest.mark.parametrize(
    ("R", "G", "r", "dh"),
    [(5, 2, 2, 32), (3, 1, 4, 64), (4, 2, 1, 128), (2, 3, 3, 48)],  # 48: the kernel's generic head dim
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_sdpa_on_strided_rows_of_unequal_lengths(kernel, R, G, r, dh, dtype):
    g = torch.Generator().manual_seed(R * 100 + dh)
    L, C, W = 3, 40, 29  # rows of the engine's buffers: a layer of [L, R, G, C, Dh], W < C read
    k_buf, v_buf = (torch.randn(L, R, G, C, dh, generator=g).to(dtype) for _ in range(2))
    k, v = k_buf[1, :, :, :W], v_buf[1, :, :, :W]
    q = torch.randn(R, G, r, dh, generator=g).to(dtype)
    length_R = torch.tensor([1, W, 17, 2, 9][:R])
    got = kernel(q, k, v, length_R)
    assert got.dtype == dtype and got.shape == (R, G, r, dh)
    want = _reference(q, k, v, length_R)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's rounding
    assert (got.float() - want).abs().max() < tol
    # Positions past a row's length are never read: NaN there changes nothing.
    short = length_R.clamp(max=17)
    before = kernel(q, k, v, short)
    k_buf[1, :, :, 17:] = float("nan")
    v_buf[1, :, :, 17:] = float("nan")
    assert torch.equal(kernel(q, k, v, short), before)


@needs_cc
def test_kernel_reads_strided_queries_in_place_and_rounds_as_torch_casts(kernel):
    # The decode rows' queries as the model leaves them: [H, S, d] seen as [S, G, r, d] (a view).
    g = torch.Generator().manual_seed(5)
    S, G, r, dh, W = 4, 2, 3, 64, 23
    length_R = torch.tensor([23, 1, 9, 16])
    for dtype in (torch.float32, torch.bfloat16):
        q_HSd = torch.randn(G * r, S, dh, generator=g).to(dtype)
        q_SGrd = q_HSd.transpose(0, 1).reshape(S, G, r, dh)
        assert not q_SGrd.is_contiguous() and q_SGrd.data_ptr() == q_HSd.data_ptr()
        k, v = (torch.randn(S, G, W, dh, generator=g).to(dtype) for _ in range(2))
        got = kernel(q_SGrd, k, v, length_R)
        assert got.dtype == dtype and got.is_contiguous()
        assert torch.equal(got, kernel(q_SGrd.contiguous(), k, v, length_R))
        # bf16 in, bf16 out: the fp32 kernel's output on the widened inputs, rounded by torch's cast.
        wide = kernel(q_SGrd.float(), k.float(), v.float(), length_R)
        assert torch.equal(got, wide.to(dtype))


@needs_cc
def test_kernel_rejects_what_it_cannot_read(kernel):
    q, k, v = torch.randn(2, 1, 2, 8), torch.randn(2, 1, 5, 8), torch.randn(2, 1, 5, 8)
    with pytest.raises(ValueError, match=r"row lengths must lie in \[1, 5\]"):
        kernel(q, k, v, torch.tensor([3, 6]))
    with pytest.raises(ValueError, match=r"row lengths must lie in \[1, 5\]"):
        kernel(q, k, v, torch.tensor([0, 2]))
    with pytest.raises(ValueError, match=r"shapes: q \(2, 1, 2, 8\), k \(2, 1, 5, 8\), v \(2, 1, 5, 4\)"):
        kernel(q, k, v[..., :4], torch.tensor([3, 2]))
    with pytest.raises(ValueError, match="contiguous int64"):
        kernel(q, k, v, torch.tensor([3, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="one dtype"):
        kernel(q, k.half(), v.half(), torch.tensor([3, 2]))
    with pytest.raises(ValueError, match="queries in torch.float32 for keys in torch.bfloat16"):
        kernel(q, k.bfloat16(), v.bfloat16(), torch.tensor([3, 2]))
    assert not cpu_decode.DecodeKernel.supports(k.half())
    assert not cpu_decode.DecodeKernel.supports(k.transpose(2, 3))


def _two_engines(model, **overrides) -> tuple[Engine, Engine]:
    cfg = {"model": "unused", "block_size": 4, "kv_cache_tokens": 4096, "max_num_batched_tokens": 64}
    cfg |= overrides
    kernel = Engine(copy.deepcopy(model), InferenceConfig(**cfg))
    sdpa = Engine(
        copy.deepcopy(model), InferenceConfig(**cfg), attention_paths=AttentionPaths(decode_kernel=False)
    )
    return kernel, sdpa


@needs_cc
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows", ["dense rows", "gather"])
def test_engine_on_the_kernel_matches_the_engine_on_sdpa(tiny_moe, monkeypatch, dtype, rows):
    model = copy.deepcopy(tiny_moe).to(getattr(torch, dtype))
    cpu_decode.load()  # built and self-checked before the count starts
    calls = []
    real = cpu_decode.DecodeKernel.__call__

    def counted(self, *args):
        calls.append(args[3].tolist())
        return real(self, *args)

    monkeypatch.setattr(cpu_decode.DecodeKernel, "__call__", counted)
    # Mixed prompt and answer lengths through three rows: rows of unequal lengths in every step.
    prompts = random_prompts([5, 37, 13, 3, 29, 8, 50], seed=11)
    budget = {"decode_buffer_tokens": 0} if rows == "gather" else {}
    engines = _two_engines(model, dtype=dtype, max_num_seqs=3, **budget)
    assert (engines[0].decode_kv is None) == (rows == "gather")
    assert engines[0].decode_kernel is not None and engines[1].decode_kernel is None
    got, want = (serve_greedy(engine, prompts) for engine in engines)
    assert any(len(set(lengths)) > 1 for lengths in calls), "rows of unequal lengths went through the kernel"
    assert len(calls) % model.args.num_hidden_layers == 0 and len(calls) > 0
    if dtype == "float32":
        assert_same_answers(got, want, tol=1e-5)
        return
    # bf16: near-ties may go either way, so each engine's answers are held to the model itself,
    # teacher-forced: the kernel's worst logprob error is no worse than SDPA's.
    worst = [worst_teacher_error(model, prompts, answers) for answers in (got, want)]
    assert worst[0] <= 1.25 * worst[1] + 0.01 and worst[1] < 0.25, worst


@needs_cc
def test_kernel_never_reads_uninitialised_rows(tiny_moe, monkeypatch):
    # Buffers born full of NaN, as in test_engine_decode_kv.py: through growth and refills, no NaN
    # reaches a logprob (the kernel reads each row to its length only).
    def nan_buffers(self, rows: int, cap: int) -> torch.Tensor:
        L, G, Dh = self._shape
        return torch.full((L, rows, G, cap, Dh), float("nan"), dtype=self._dtype)

    monkeypatch.setattr(DecodeKV, "_empty", nan_buffers)
    engine, _ = _two_engines(tiny_moe, max_num_seqs=3)
    for i, p in enumerate(random_prompts([5, 30, 13, 3, 21, 8], seed=7)):
        engine.add_request(f"r{i}", p, SamplingOptions(temperature=0.0, max_tokens=20, ignore_eos=True))
    out = drain(engine)
    assert all(torch.isfinite(torch.tensor(r.logprobs)).all() for r in out.values())
    assert engine.decode_kv.capacity >= 50


def test_config_false_and_other_dtypes_run_sdpa(make_engine, tiny_moe):
    engine = make_engine(cpu_decode_kernel=False)
    assert engine.decode_kernel is None
    assert engine.decode_attention_note == "decode attention SDPA (cpu_decode_kernel = false)"
    assert "; decode attention SDPA (cpu_decode_kernel = false)" in _kernels_note(engine)
    half = make_engine(copy.deepcopy(tiny_moe).half())  # a model handed over in fp16
    assert (
        half.decode_kernel is None
        and half.decode_attention_note == "decode attention SDPA (no kernel for torch.float16)"
    )
    mla = make_engine(Transformer(preset_args("tiny-dsv3")).eval())  # decodes in its latent space
    assert mla.decode_kernel is None and mla.decode_attention_note == ""


@needs_cc
def test_build_is_cached_per_compiler_and_cpu(fresh_load, tmp_path):
    first = fresh_load()
    assert first.kernel is not None and first.note == "decode attention C kernel"
    (built,) = (tmp_path / "kernels").glob("cpu_decode-*.so")
    mtime = built.stat().st_mtime_ns
    fresh_load.cache_clear()
    assert fresh_load().kernel is not None
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [built.name]  # no temporary left behind
    assert built.stat().st_mtime_ns == mtime, "found, not built again"


def test_no_compiler_means_sdpa(fresh_load, monkeypatch, make_engine):
    monkeypatch.setenv("CC", "no-such-compiler-asyncrl")
    build = fresh_load()
    assert build.kernel is None
    assert build.note == "decode attention SDPA (CC='no-such-compiler-asyncrl' not found)"
    engine = make_engine()
    assert engine.decode_kernel is None and engine.decode_attention_note == build.note
    engine.add_request("a", [1, 2, 3], SamplingOptions(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(drain(engine)["a"].tokens) == 3


def test_a_failing_build_means_sdpa_and_says_why(fresh_load, monkeypatch, tmp_path):
    cc = tmp_path / "broken-cc"
    cc.write_text("#!/bin/sh\necho 'cpu_decode.c:1: error: something broke' >&2\nexit 1\n")
    cc.chmod(cc.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", str(cc))
    build = fresh_load()
    assert build.kernel is None
    assert build.note.startswith("decode attention SDPA (kernel failed: broken-cc exited 1: ")
    assert "something broke" in build.note
    assert not list((tmp_path / "kernels").iterdir()), "no partial library left behind"


@needs_cc
def test_self_check_rejects_a_kernel_that_computes_wrong(kernel):
    class Wrong(cpu_decode.DecodeKernel):
        def __call__(self, q, k, v, length_R):
            return torch.zeros_like(q)

    wrong = object.__new__(Wrong)
    with pytest.raises(RuntimeError, match="self-check: torch.float32 output differs from SDPA"):
        cpu_decode._self_check(wrong)
    cpu_decode._self_check(kernel)  # the real one passes
