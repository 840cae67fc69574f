"""The CPU matmul kernels (asyncrl.inference.cpu_matmul): torch's experts and linears in fp32 and,
rounding where torch's bf16 path rounds, in bf16, on sizes that are not multiples of their blocks;
when they take a call and when they leave it to torch; input checks and weight updates; the
engine's tokens and logprobs against the same engine on torch's matmuls; and torch's matmuls
whenever the kernels cannot be built."""

import copy
import pickle
import shutil

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
from asyncrl.inference import Engine, SamplingOptions, cpu_matmul
from asyncrl.model import compute
from asyncrl.model.moe import GroupedExperts, Router, grouped_swiglu

HAS_CC = any(shutil.which(c) for c in ("cc", "gcc", "clang"))


@pytest.fixture(scope="module")
def kernels() -> cpu_matmul.Kernels:
    if not HAS_CC:
        pytest.skip("no C compiler on PATH: the engine runs torch's matmuls (tested below)")
    build = cpu_matmul.load()
    if build.kernels is None and "no AVX-512" in build.note:
        pytest.skip(f"this CPU has no kernel: {build.note}")
    assert build.kernels is not None, build.note
    return build.kernels


@pytest.fixture(scope="module")
def kernel(kernels) -> cpu_matmul.MoEKernel:
    return kernels.experts


def _experts(E: int, D: int, H: int, dtype: torch.dtype, seed: int) -> GroupedExperts:
    g = torch.Generator().manual_seed(seed)
    module = GroupedExperts(E, D, H)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return module.to(dtype)


def _routing(N: int, K: int, E: int, seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K distinct experts per token out of the first E - 1 (the last one gets no token)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(N)])
    return ids, torch.rand(N, K, generator=g).softmax(-1).to(dtype)


def _count_runs(monkeypatch, cls=cpu_matmul.MoEKernel, method: str = "run") -> list[int]:
    """The row count of each call of `cls`'s kernel (its `method`) from now on."""
    calls = []
    real = getattr(cls, method)

    def counted(self, *args, **kwargs):
        calls.append(args[0].numel() // args[0].shape[-1])  # rows of [N, D] or [B, T, D]
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cls, method, counted)
    return calls


def _torch_rounding_each_step(x, ids, weights, m: GroupedExperts) -> torch.Tensor:
    """GroupedExperts.forward's arithmetic with every matmul in x's dtype (the per-expert loop with a
    plain matmul: torch's native bf16 path, which rounds after each op)."""
    N, K = ids.shape
    order = ids.reshape(-1).argsort(stable=True)
    counts = torch.bincount(ids.reshape(-1), minlength=m.num_experts)
    weights_of = (m.gate_proj, m.up_proj, m.down_proj)
    y = grouped_swiglu(x.index_select(0, order // K), counts, *weights_of, linear=lambda a, w: a @ w.T)
    y_NKD = torch.empty_like(y).index_copy_(0, order, y)
    return (y_NKD.view(N, K, -1) * weights.unsqueeze(-1)).sum(dim=1)


@pytest.mark.parametrize(
    ("N", "K", "E", "D", "H"), [(1, 2, 5, 34, 20), (7, 3, 9, 64, 48), (40, 2, 4, 96, 130)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_computes_torchs_experts(kernel, N, K, E, D, H, dtype):
    if dtype not in kernel.dtypes:
        pytest.skip(f"no {dtype} kernel on this CPU (bf16 needs AVX-512 BF16)")
    m = _experts(E, D, H, dtype, seed=N + D)
    x = torch.randn(N, D, generator=torch.Generator().manual_seed(N)).to(dtype)
    ids, weights = _routing(N, K, E, seed=H, dtype=dtype)
    with torch.inference_mode():
        got = kernel.run(x, ids, weights, m.gate_proj, m.up_proj, m.down_proj, dtype)
        want = _torch_rounding_each_step(x, ids, weights, m)
        exact = _torch_rounding_each_step(x.double(), ids, weights.double(), m.double())
    assert got.dtype == dtype and got.shape == (N, D)
    if dtype == torch.float32:
        assert (got - want).abs().max() < 1e-5
        return
    # bf16: the same roundings as torch's, so the same values but where an fp32 sum lands on a
    # rounding boundary in one order and not in the other (none in these cases, rare in general).
    assert (got != want).float().mean() <= 0.01
    assert (got.double() - exact).abs().max() <= 1.01 * (want.double() - exact).abs().max()


def test_fp32_kernels_silu_is_within_a_few_ulp_over_the_whole_range(kernel):
    # One expert wired so that its output is silu of its input: gate unit h reads input h, up reads
    # input H (a constant 1), down copies unit h to output h; every sum adds exact zeros. So the
    # kernel's vectorised e^x is held to fp64 across the range, and to its clamp beyond it.
    H, D = 16, 32
    ends = [-1e4, -200.0, -88.5, -0.0, 88.5, 200.0, 1e4, 1e-30, -1e-30]
    g = torch.cat([torch.linspace(-30, 30, 2007), torch.tensor(ends)]).view(-1, H)  # 2016 values
    x = torch.cat([g, torch.ones(len(g), 1), torch.zeros(len(g), D - H - 1)], dim=1)
    gate, up, down = torch.zeros(1, H, D), torch.zeros(1, H, D), torch.zeros(1, D, H)
    gate[0, :, :H] = torch.eye(H)
    up[0, :, H] = 1.0
    down[0, :H] = torch.eye(H)
    ids, weights = torch.zeros(len(g), 1, dtype=torch.int64), torch.ones(len(g), 1)
    with torch.inference_mode():
        got = kernel.run(x, ids, weights, gate, up, down, torch.float32)[:, :H].double()
    want = F.silu(g.double())
    err, normal = (got - want).abs(), want.abs() >= 1e-30
    assert (err[normal] / (torch.finfo(torch.float32).eps * want[normal].abs())).max() <= 3  # in ulp
    assert err[~normal].max() <= 1e-30  # silu(g) of g below -88 or near 0


def test_bf16_experts_torch_upcasts_go_through_the_fp32_kernel(kernel):
    # tiny experts (under compute.MIN_NATIVE_EXPERT weights): torch computes them in fp32 and rounds
    # once; so does the kernel, and its output is torch's up to that last rounding. The kernel
    # widens the bf16 inputs and rounds its output itself: exactly the fp32 kernel between torch's
    # casts.
    if torch.bfloat16 not in kernel.dtypes:
        pytest.skip("no bf16 kernel on this CPU (needs AVX-512 BF16)")
    m = _experts(8, 64, 32, torch.bfloat16, seed=1)
    x = torch.randn(12, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    ids, weights = _routing(12, 2, 8, seed=3, dtype=torch.bfloat16)
    experts = (m.gate_proj, m.up_proj, m.down_proj)
    with torch.inference_mode():
        got = kernel(x, ids, weights, *experts)
        want = m(x, ids, weights)  # no kernel set: torch's path
        cast = kernel.run(x.float(), ids, weights.float(), *experts, torch.float32).bfloat16()
        with pytest.raises(ValueError, match="bf16_io is for the fp32 kernel"):
            kernel.run(x, ids, weights, *experts, torch.bfloat16, bf16_io=True)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, cast)
    assert (got.float() - want.float()).abs().max() <= 2 * 2**-8 * want.float().abs().max()
    assert "cpu_moe_torch.float32" in m.gate_proj._asyncrl_kept, "packed for the fp32 kernel"


def test_bf16_linears_torch_upcasts_go_through_the_bf16_kernel(kernels):
    # a linear too small for torch's native bf16: torch computes it in fp32 and rounds once; the
    # bf16 kernel's products of bf16 pairs are exact and summed in fp32, so it rounds the same sum
    # once, with no casts and no fp32 copy of the weight.
    if torch.bfloat16 not in kernels.dtypes:
        pytest.skip("no bf16 kernel on this CPU (needs AVX-512 BF16)")
    layer = compute.Linear(64, 48, bias=False).bfloat16()
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    with torch.inference_mode():
        assert compute.cpu_upcast(x, linear_numel=layer.weight.numel()), "torch's path: fp32"
        want = layer(x)
        layer.cpu_kernel = kernels.linear
        got = layer(x)
    assert got.dtype == torch.bfloat16
    assert (got != want).float().mean() <= 0.01
    assert (got.float() - want.float()).abs().max() <= 2**-7 * want.float().abs().max()
    kept = layer.weight._asyncrl_kept
    assert "cpu_linear_torch.bfloat16" in kept and "cpu_linear_torch.float32" not in kept


def test_module_uses_the_kernel_only_where_it_takes_the_call(kernel, monkeypatch):
    m = _experts(4, 32, 16, torch.float32, seed=5)
    m.cpu_kernel = kernel
    calls = _count_runs(monkeypatch)
    ids, weights = _routing(8, 2, 4, seed=0, dtype=torch.float32)
    x = torch.randn(8, 32)
    with torch.inference_mode():
        m(x, ids, weights)
    assert calls == [8]
    m(x, ids, weights)  # under autograd: torch's path
    with torch.inference_mode():
        big = cpu_matmul.MAX_ROWS_PER_EXPERT * 4 // 2 + 1  # one row over the limit per expert, on average
        ids_big, w_big = _routing(big, 2, 4, seed=1, dtype=torch.float32)
        m(torch.randn(big, 32), ids_big, w_big)  # a prefill-sized call: torch's path
        assert not kernel.takes(torch.randn(4, 32).half(), 4, 2)
        assert not kernel.takes(torch.randn(0, 32), 4, 2)
    assert calls == [8]


def test_kernel_follows_weight_updates_and_rejects_bad_input(kernel):
    m = _experts(4, 32, 16, torch.float32, seed=6)
    ids, weights = _routing(5, 2, 4, seed=2, dtype=torch.float32)
    x = torch.randn(5, 32)
    args = (m.gate_proj, m.up_proj, m.down_proj)
    with torch.inference_mode():
        before = kernel(x, ids, weights, *args)
    with torch.no_grad():
        m.down_proj.mul_(2.0)  # in place, as a weight update writes
    with torch.inference_mode():
        assert torch.allclose(kernel(x, ids, weights, *args), 2 * before, atol=1e-6)
        with pytest.raises(ValueError, match=r"an expert id outside \[0, E\)"):
            kernel(x, torch.tensor([[0, 4]] * 5), weights, *args)
        with pytest.raises(ValueError, match=r"ids \(4, 2\) and weights \(5, 2\) for 5 tokens"):
            kernel(x, ids[:4], weights, *args)
        with pytest.raises(ValueError, match="expert weights: gate"):
            kernel(x, ids, weights, m.gate_proj, m.up_proj, m.down_proj[:, :16])


@pytest.mark.parametrize(
    ("shape", "P", "C"), [((1, 64), 100, 64), ((2, 3, 48), 32, 48), ((16, 200), 33, 200)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_kernel_computes_torchs_linear(kernels, shape, P, C, dtype):
    if dtype not in kernels.dtypes:
        pytest.skip(f"no {dtype} kernel on this CPU (bf16 needs AVX-512 BF16)")
    g = torch.Generator().manual_seed(P + C)
    x = torch.randn(shape, generator=g).to(dtype)
    w = (torch.randn(P, C, generator=g) * C**-0.5).to(dtype)
    with torch.inference_mode():
        got = kernels.linear.run(x, w, dtype)
        want = x @ w.T  # bf16: one rounding of an fp32 sum, as the kernel's
    assert got.dtype == dtype and got.shape == (*shape[:-1], P)
    if dtype == torch.float32:
        assert (got - want).abs().max() < 1e-5
    else:
        assert (got != want).float().mean() <= 0.01
        assert (got.float() - want.float()).abs().max() <= 2**-7 * want.float().abs().max()


def test_linear_module_uses_the_kernel_for_few_rows_only(kernels, monkeypatch):
    calls = _count_runs(monkeypatch, cpu_matmul.LinearKernel)
    layer = compute.Linear(64, 40, bias=False)
    layer.cpu_kernel = kernels.linear
    biased = compute.Linear(64, 40)
    biased.cpu_kernel = kernels.linear
    x = torch.randn(3, 64)
    with torch.inference_mode():
        assert torch.allclose(layer(x), x @ layer.weight.T, atol=1e-5)
        layer(torch.randn(cpu_matmul.MAX_LINEAR_ROWS + 1, 64))  # more rows: torch
        biased(x)  # a bias: torch
        assert not kernels.linear.takes(x.half(), layer.weight.half(), None)
    layer(x)  # under autograd: torch
    assert calls == [3]
    with torch.no_grad():
        layer.weight.mul_(-1.0)  # a weight update in place: the kept copy follows
    with torch.inference_mode():
        assert torch.allclose(layer(x), x @ layer.weight.T, atol=1e-5)
        with pytest.raises(ValueError, match="input of 48 features for a weight of 64"):
            kernels.linear.run(torch.randn(2, 48), layer.weight, torch.float32)


def test_small_bf16_linears_take_the_kernel_at_any_row_count(kernels, monkeypatch):
    # Where torch would widen a bf16 linear to fp32 (a weight below MIN_NATIVE_LINEAR on a CPU with
    # native bf16), the kernel takes prefill-sized inputs too; larger weights, and a forced native
    # path, leave them to torch.
    if torch.bfloat16 not in kernels.dtypes:
        pytest.skip("this CPU's kernels have no bf16 (AVX-512 BF16)")
    monkeypatch.setattr(compute, "_cpu_native", lambda dtype: True)  # as on a CPU with AVX-512 BF16
    monkeypatch.setattr(
        compute,
        "cpu_kernels",
        lambda: compute.CpuKernels(isa="AVX512 AVX512_BF16", native_bf16=True, amx=False),
    )
    calls = _count_runs(monkeypatch, cpu_matmul.LinearKernel)
    rows = 4 * cpu_matmul.MAX_LINEAR_ROWS + 3
    small = compute.Linear(64, 48, bias=False).to(torch.bfloat16)
    large = compute.Linear(256, compute.MIN_NATIVE_LINEAR // 256, bias=False).to(torch.bfloat16)
    for layer in (small, large):
        layer.cpu_kernel = kernels.linear
    x = torch.randn(rows, 64).to(torch.bfloat16)
    with torch.inference_mode():
        got = small(x)
        want = (x.float() @ small.weight.float().T).to(torch.bfloat16)  # torch's fp32 path, rounded once
        assert (got != want).float().mean() <= 0.01
        assert (got.float() - want.float()).abs().max() <= 2**-7 * want.float().abs().max()
        assert calls == [rows]
        large(torch.randn(rows, 256).to(torch.bfloat16))  # native bf16 in torch: torch
        small(x[: cpu_matmul.MAX_LINEAR_ROWS])  # few rows: the kernel, as before
        assert calls == [rows, cpu_matmul.MAX_LINEAR_ROWS]
        assert not kernels.linear.takes(x.float(), small.weight.float(), None)  # fp32: few rows only
        compute.set_cpu_upcast(False)  # native bf16 forced everywhere: torch's matmul
        try:
            assert not kernels.linear.takes(x, small.weight, None)
        finally:
            compute.set_cpu_upcast(None)


def _torch_routing(router: Router, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.inference_mode():
        kernel, router.cpu_kernel = router.cpu_kernel, None
        try:
            ids, weights, _ = router(x)
        finally:
            router.cpu_kernel = kernel
    return ids, weights


def _router(E: int, D: int, K: int, norm: bool, dtype: torch.dtype, seed: int) -> Router:
    g = torch.Generator().manual_seed(seed)
    router = Router(D, E, K, norm)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, D, generator=g) * D**-0.5)
    return router.to(dtype)


@pytest.mark.parametrize(
    ("N", "E", "D", "K"), [(1, 8, 128, 2), (37, 60, 70, 4), (300, 8, 33, 1), (5, 128, 512, 8)]
)
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_kernel_computes_torchs_routing(kernels, monkeypatch, N, E, D, K, norm, dtype):
    if dtype not in kernels.dtypes:
        pytest.skip(f"no {dtype} kernel on this CPU")
    router = _router(E, D, K, norm, dtype, seed=N + E)
    router.cpu_kernel = kernels.router
    calls = _count_runs(monkeypatch, cpu_matmul.RouterKernel, "__call__")
    x = torch.randn(N, D, generator=torch.Generator().manual_seed(D)).to(dtype)
    with torch.inference_mode():
        ids, weights, own = router(x, with_router_topk=True)
    want_ids, want_weights = _torch_routing(router, x)
    assert calls == [N], "the kernel routed the tokens"
    assert ids.dtype == torch.int64 and weights.dtype == dtype and own is ids
    assert torch.equal(ids, want_ids)
    if dtype == torch.float32:
        torch.testing.assert_close(weights, want_weights, rtol=2e-6, atol=1e-7)
    else:  # the same fp32 values but for the order of sums, rounded once: at most one bf16 step apart
        err = (weights.float() - want_weights.float()).abs().max()
        assert err <= 2**-8 * want_weights.float().abs().max()
    if norm:
        torch.testing.assert_close(weights.float().sum(-1), torch.ones(N), atol=2e-2, rtol=0)


def test_router_kernel_breaks_ties_toward_the_lower_expert_and_keeps_ids_distinct(kernels):
    w = torch.zeros(6, 16)
    w[1] = w[4] = 1.0  # experts 1 and 4 tie at the top, the other four at zero
    x = torch.ones(3, 16)
    x[2] = float("nan")  # a row of NaNs still gets K distinct experts in [0, E)
    with torch.inference_mode():
        ids, weights = kernels.router(x, w, 3, False)
    assert ids[:2].tolist() == [[1, 4, 0], [1, 4, 0]]
    torch.testing.assert_close(weights[0, :2], weights[0, :2].flip(0))
    assert len(set(ids[2].tolist())) == 3
    assert int(ids.min()) >= 0 and int(ids.max()) < 6


def test_router_module_uses_the_kernel_only_where_it_takes_the_call(kernels, monkeypatch):
    router = _router(8, 64, 2, True, torch.float32, seed=3)
    router.cpu_kernel = kernels.router
    calls = _count_runs(monkeypatch, cpu_matmul.RouterKernel, "__call__")
    x = torch.randn(4, 64)
    router(x)  # autograd on (the trainer): torch's ops
    with torch.inference_mode():
        replay = torch.tensor([[0, 1]] * 4)
        ids, _, own = router(x, replay, with_router_topk=True)  # replay: torch's ops
        assert torch.equal(ids, replay) and own is not None
        rows = cpu_matmul.MAX_ROUTER_MACS // (8 * 64)
        router(torch.randn(rows + 1, 64))  # more multiply-adds than the limit: torch's ops
        assert calls == []
        router(torch.randn(rows, 64))
        assert calls == [rows]
        big = _router(cpu_matmul.ROUTER_MAX_EXPERTS + 1, 2, 2, True, torch.float32, seed=4)
        assert not kernels.router.takes(torch.randn(1, 2), big.weight, 2)
        assert not kernels.router.takes(x, router.weight.to(torch.bfloat16), 2)  # the weight in fp32 only
        assert not kernels.router.takes(x, router.weight.t().contiguous().t(), 2)  # and contiguous
        with pytest.raises(ValueError, match="top 9"):
            kernels.router(x, router.weight, 9, True)


def test_a_model_with_kernels_set_copies_and_pickles(kernels, tiny_moe):
    engine = Engine(
        copy.deepcopy(tiny_moe), InferenceConfig(model="unused", block_size=4, kv_cache_tokens=4096)
    )
    copied = copy.deepcopy(engine.model)
    restored = pickle.loads(pickle.dumps(engine.model))
    for model in (copied, restored):
        experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
        linears = [m for m in model.modules() if isinstance(m, compute.Linear)]
        routers = [m for m in model.modules() if isinstance(m, Router)]
        assert experts and all(m.cpu_kernel is kernels.experts for m in experts)
        assert linears and all(m.cpu_kernel is kernels.linear for m in linears)
        assert routers and all(m.cpu_kernel is kernels.router for m in routers)


def _two_engines(model, **overrides) -> tuple[Engine, Engine]:
    cfg = {"model": "unused", "block_size": 4, "kv_cache_tokens": 4096, "max_num_batched_tokens": 64}
    cfg |= overrides
    on = Engine(copy.deepcopy(model), InferenceConfig(**cfg))
    off = Engine(copy.deepcopy(model), InferenceConfig(**cfg, cpu_matmul_kernel=False))
    return on, off


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_on_the_kernels_matches_the_engine_on_torchs_matmuls(kernels, tiny_moe, monkeypatch, dtype):
    model = copy.deepcopy(tiny_moe).to(getattr(torch, dtype))
    calls = _count_runs(monkeypatch)
    linear_calls = _count_runs(monkeypatch, cpu_matmul.LinearKernel)
    prompts = random_prompts([5, 37, 13, 3, 29, 8, 50], seed=12)
    engines = _two_engines(model, dtype=dtype, max_num_seqs=3)
    assert engines[0].matmul_kernel_note.startswith(
        f"decode matmuls C kernels (MoE routers and experts, linears of <= {cpu_matmul.MAX_LINEAR_ROWS} rows"
    )
    assert engines[1].matmul_kernel_note == "decode matmuls torch (cpu_matmul_kernel = false)"
    got, want = (serve_greedy(engine, prompts) for engine in engines)
    assert set(calls) >= {1, 2, 3}, "decode steps of 1-3 sequences went through the experts kernel"
    assert set(linear_calls) >= {1, 2, 3} and max(linear_calls) <= cpu_matmul.MAX_LINEAR_ROWS
    assert max(linear_calls) >= 37, "a whole prompt's prefill chunk went through the linear kernel too"
    if dtype == "float32":
        assert_same_answers(got, want, tol=1e-5)
        return
    # bf16: each engine's answers held to the model itself, teacher-forced (as in test_cpu_decode.py)
    worst = [worst_teacher_error(model, prompts, answers) for answers in (got, want)]
    assert worst[0] <= 1.25 * worst[1] + 0.01 and worst[1] < 0.25, worst


def test_bf16_prefill_chunks_of_a_small_model_go_through_the_linear_kernel(kernels, tiny_moe, monkeypatch):
    # tiny-moe's projections are below MIN_NATIVE_LINEAR: torch would widen them to fp32, so the
    # kernel takes whole prefill chunks too; the answers stay as close to the model as torch's.
    if torch.bfloat16 not in kernels.dtypes or compute.cpu_kernels().amx:
        pytest.skip(
            "the rule applies where bf16 kernels exist and torch's small bf16 linears upcast (no AMX)"
        )
    model = copy.deepcopy(tiny_moe).to(torch.bfloat16)
    linear_calls = _count_runs(monkeypatch, cpu_matmul.LinearKernel)
    prompts = random_prompts([150, 37, 90], seed=13)
    engines = _two_engines(model, dtype="bfloat16", max_num_seqs=3, max_num_batched_tokens=512)
    got, want = (serve_greedy(engine, prompts) for engine in engines)
    assert max(linear_calls) >= 277, "the first step's chunk of all three prompts went through the kernel"
    worst = [worst_teacher_error(model, prompts, answers) for answers in (got, want)]
    assert worst[0] <= 1.25 * worst[1] + 0.01 and worst[1] < 0.25, worst


def test_no_kernel_means_torchs_matmuls_and_says_why(tiny_moe, monkeypatch, tmp_path):
    monkeypatch.setenv("ASYNCRL_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setenv("CC", "no-such-compiler-asyncrl")
    cpu_matmul.load.cache_clear()
    try:
        build = cpu_matmul.load()
        assert build.kernels is None
        assert build.note == "decode matmuls torch (CC='no-such-compiler-asyncrl' not found)"
        engine = Engine(
            copy.deepcopy(tiny_moe),
            InferenceConfig(model="unused", block_size=4, kv_cache_tokens=4096, cpu_decode_kernel=False),
        )
        assert engine.matmul_kernel_note == build.note
        hooked = [m for m in engine.model.modules() if isinstance(m, GroupedExperts | compute.Linear)]
        assert hooked and all(m.cpu_kernel is None for m in hooked)
        engine.add_request("a", [1, 2, 3], SamplingOptions(temperature=0.0, max_tokens=3, ignore_eos=True))
        assert len(drain(engine)["a"].tokens) == 3
    finally:
        forget_kernel_loads()  # the engine's model loaded the RMSNorm kernel under this CC too
