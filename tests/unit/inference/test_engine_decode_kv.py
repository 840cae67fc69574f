"""Dense decode rows (asyncrl.inference.decode_kv) give exactly the paged gather path's tokens and
logprobs, through admission, finish, preemption, prefix hits, capacity growth, the budget fallback
and a keep-mode weight swap; each row holds its request's paged K/V. Both read their keys through
SDPA here (bit for bit the same attention); the CPU decode kernel over the same rows is held to
SDPA in test_cpu_decode.py."""

import copy

import torch
from inference_helpers import drain, random_prompts

from asyncrl.config.inference import InferenceConfig
from asyncrl.inference import Engine, SamplingOptions
from asyncrl.inference.decode_kv import ANTICIPATE, DecodeKV
from asyncrl.inference.kv_cache import AttentionPaths
from asyncrl.inference.request import Request
from weight_update_reference import perturb_all_weights

GATHER = AttentionPaths(decode_buffer=False, decode_kernel=False)
DENSE = AttentionPaths(decode_kernel=False)


def _engine(model, paths: AttentionPaths = DENSE, **overrides) -> Engine:
    cfg = {"model": "unused", "block_size": 4, "kv_cache_tokens": 4096, "max_num_batched_tokens": 64}
    return Engine(copy.deepcopy(model), InferenceConfig(**(cfg | overrides)), attention_paths=paths)


def _add(engine: Engine, prompts: list[list[int]]) -> None:
    for i, p in enumerate(prompts):
        greedy = i % 2 == 0
        opts = SamplingOptions(
            temperature=0.0 if greedy else 0.8, max_tokens=6 + 7 * (i % 5), ignore_eos=True, seed=i
        )
        engine.add_request(f"r{i}", p, opts)


def _same_as_gather(model, prompts: list[list[int]], **overrides) -> Engine:
    """Run `prompts` with dense rows and with the gather path; assert identical outputs."""
    dense, gather = _engine(model, **overrides), _engine(model, GATHER, **overrides)
    _add(dense, prompts)
    _add(gather, prompts)
    got, want = drain(dense), drain(gather)
    assert got.keys() == want.keys()
    for rid in want:
        assert got[rid].tokens == want[rid].tokens, rid
        assert torch.equal(torch.tensor(got[rid].logprobs), torch.tensor(want[rid].logprobs)), rid
    assert gather.decode_kv is None
    return dense


def test_same_as_gather_through_admission_finish_and_growth(tiny_moe):
    # Four rows for ten requests of mixed lengths: rows are released, compacted and refilled, and
    # the capacity doubles as contexts grow.
    prompts = random_prompts([5, 37, 13, 3, 29, 8, 50, 17, 1, 22], seed=1)
    dense = _same_as_gather(tiny_moe, prompts, max_num_seqs=4)
    kv = dense.decode_kv
    assert kv.num_fills == len(prompts) and kv.num_fallbacks == 0
    assert kv.capacity >= 63  # the longest context: 29 + 34 tokens


def test_same_as_gather_through_preemption_and_budget_fallback(tiny_moe):
    # A 96-token pool preempts; the dense rows (budget: the pool's size) overflow and fall back.
    prompts = random_prompts([10, 12, 8, 14, 9, 11], seed=3)
    dense = _same_as_gather(tiny_moe, prompts, kv_cache_tokens=96, max_model_len=96, max_num_seqs=6)
    assert dense.stats()["preemptions"] > 0
    assert dense.decode_kv.num_fallbacks > 0 and dense.decode_kv.num_fills > 0


def test_same_as_gather_with_prefix_hits(tiny_moe):
    # 17-token prompts over a shared 16-token prefix: a later request's first step after the hit is
    # a one-token "decode" whose row is filled from the cached blocks.
    (shared,) = random_prompts([16], seed=4)
    prompts = [[*shared, i] for i in range(6)] + [[*shared, 7, 8, 9]]
    dense = _same_as_gather(tiny_moe, prompts, max_num_seqs=3)
    assert dense.stats()["prefix_cache_hits"] > 0


def test_rows_hold_the_paged_kv_of_their_requests(tiny_moe):
    engine = _engine(tiny_moe, max_num_seqs=3)
    _add(engine, random_prompts([7, 21, 4, 15, 9], seed=5))
    bs = engine.cache.block_size
    for _ in range(30):
        engine.step()
        kv = engine.decode_kv
        for row, (req, _) in enumerate(kv.owners):
            if req.finished or req not in engine.scheduler.running:
                continue  # released on the next step
            n = req.num_computed_tokens
            slots = torch.tensor([req.block_ids[p // bs] * bs + p % bs for p in range(n)])
            for layer in range(engine.model.args.num_hidden_layers):
                paged = engine.cache.k_LPGd[layer][slots].transpose(0, 1)
                assert torch.equal(kv.k_LRGCd[layer, row, :, :n], paged)
                paged = engine.cache.v_LPGd[layer][slots].transpose(0, 1)
                assert torch.equal(kv.v_LRGCd[layer, row, :, :n], paged)
    assert kv.num_fills == 5


def test_keep_mode_weight_swap_keeps_rows(tiny_moe):
    prompts = random_prompts([9, 14, 6], seed=6)
    new = dict(perturb_all_weights(tiny_moe, seed=0, scale=0.2).named_parameters())
    results = []
    for paths in (DENSE, GATHER):
        engine = _engine(tiny_moe, paths)
        _add(engine, prompts)
        for _ in range(5):
            engine.step()
        fills = None if engine.decode_kv is None else engine.decode_kv.num_fills
        engine.load_weights({k: v.clone() for k, v in new.items()}, version=1)
        results.append(drain(engine))
        if engine.decode_kv is not None:
            assert engine.decode_kv.num_fills == fills, "running requests keep their rows"
    got, want = results
    for rid in want:
        assert got[rid].tokens == want[rid].tokens
        assert torch.equal(torch.tensor(got[rid].logprobs), torch.tensor(want[rid].logprobs))


def test_uninitialised_memory_never_reaches_attention(tiny_moe, monkeypatch):
    # Buffers born full of NaN: a masked position still meets a zero weight, and 0 * NaN is NaN, so
    # any position read before it is written would poison the logprobs. Growth and refills included.
    def nan_buffers(self, rows: int, cap: int) -> torch.Tensor:
        L, G, Dh = self._shape
        return torch.full((L, rows, G, cap, Dh), float("nan"), dtype=self._dtype)

    monkeypatch.setattr(DecodeKV, "_empty", nan_buffers)
    prompts = random_prompts([5, 30, 13, 3, 21, 8], seed=7)
    dense = _same_as_gather(tiny_moe, prompts, max_num_seqs=3)
    assert dense.decode_kv.num_fills == len(prompts) and dense.decode_kv.capacity >= 50


def _small_buffers(budget_tokens: int) -> DecodeKV:
    """One layer, one kv head of 2 dims, blocks of 4 positions, at most 4 rows."""
    return DecodeKV(
        num_layers=1,
        num_kv_heads=1,
        head_dim=2,
        block_size=4,
        max_rows=4,
        budget_tokens=budget_tokens,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )


def test_growth_doubles_then_takes_what_the_budget_allows():
    kv = _small_buffers(budget_tokens=100)
    # One token each: capacity has nothing to anticipate, so it doubles.
    options = SamplingOptions(max_tokens=1)
    reqs = [Request(request_id=str(i), prompt_token_ids=[1], options=options) for i in range(4)]
    for r in reqs:
        r.block_ids = list(range(8))

    def plan(num_rows: int, num_ctx: int):
        return kv.plan([(r, num_ctx) for r in reqs[:num_rows]])

    assert plan(2, 6) is not None and (kv.k_LRGCd.shape[1], kv.capacity) == (2, 8)
    assert plan(4, 6) is not None and (kv.k_LRGCd.shape[1], kv.capacity) == (4, 8)
    assert plan(4, 9) is not None and kv.capacity == 16  # doubled
    assert plan(4, 17) is not None and kv.capacity == 25  # 32 would pass the budget: 100 // 4
    assert plan(4, 26) is None and kv.num_fallbacks == 1 and kv.num_rows == 0  # 28 positions: over


def test_capacity_grows_at_once_to_the_longest_final_context_within_anticipate_times_the_width():
    kv = _small_buffers(budget_tokens=1000)
    # Final contexts 20 + 38 = 58 and 10 + 20 = 30 positions: 60 in whole blocks.
    reqs = [
        Request(request_id="a", prompt_token_ids=[1] * 20, options=SamplingOptions(max_tokens=38)),
        Request(request_id="b", prompt_token_ids=[1] * 10, options=SamplingOptions(max_tokens=20)),
    ]
    for r in reqs:
        r.block_ids = list(range(15))
    assert kv.plan([(reqs[0], 21), (reqs[1], 11)]) is not None
    assert kv.capacity == 60  # not the 24 positions of the step's width
    buffers = kv.k_LRGCd
    for n in range(22, 59):
        assert kv.plan([(reqs[0], n), (reqs[1], min(n, 30))]) is not None
    assert kv.k_LRGCd is buffers, "no growth (and no copy) while the answers run to max_tokens"
    assert kv.plan([(reqs[0], 61), (reqs[1], 30)]) is not None and kv.capacity == 120  # past it: doubles

    far = _small_buffers(budget_tokens=10_000)
    long = Request(request_id="c", prompt_token_ids=[1] * 6, options=SamplingOptions(max_tokens=4000))
    long.block_ids = list(range(2))
    assert far.plan([(long, 7)]) is not None and far.capacity == ANTICIPATE * 8
