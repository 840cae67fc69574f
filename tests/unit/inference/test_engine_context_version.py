"""`RequestOutput.context_version`: the oldest weights version whose KV a request attended over.

A prompt prefilled in chunks across an update, a turn whose prompt the old weights computed, and a
request preempted after an update all report the older version, never a newer one than they used.
"""

from inference_helpers import Result, drain, random_prompts

from asyncrl.inference import SamplingOptions
from weight_update_reference import perturb_all_weights

GREEDY = SamplingOptions(temperature=0.0, max_tokens=5, ignore_eos=True)


def _new_weights(model):
    return {
        k: v.detach().clone() for k, v in perturb_all_weights(model, seed=4, scale=0.2).state_dict().items()
    }


def _step(engine, results: dict[str, Result]) -> None:
    for out in engine.step():
        results.setdefault(out.request_id, Result()).add(out)


def test_prompt_prefilled_across_an_update_reports_the_older_version(make_engine, tiny_moe):
    engine = make_engine(max_num_batched_tokens=16)
    (prompt,) = random_prompts([40], seed=30)
    engine.add_request("spans", prompt, GREEDY)
    results: dict[str, Result] = {}
    _step(engine, results)  # 16 of 40 prompt tokens, under v0; nothing sampled yet
    assert results == {}
    engine.load_weights(_new_weights(tiny_moe), version=1)
    engine.add_request("after", prompt, GREEDY)
    drain(engine, results)
    spans, after = results["spans"], results["after"]
    assert spans.versions == [1] * 5, "every token was sampled by v1..."
    assert spans.final.context_version == 0, "...over prompt KV that v0 computed in part"
    assert after.versions == [1] * 5 and after.final.context_version == 1


def test_no_update_reports_the_version_of_the_tokens(make_engine):
    engine = make_engine()
    engine.add_request("r", random_prompts([9], seed=31)[0], GREEDY)
    assert drain(engine)["r"].final.context_version == 0


def test_a_turn_whose_prompt_kv_is_older_than_its_tokens(make_engine, tiny_moe):
    engine = make_engine(max_num_batched_tokens=16)
    first, new_tokens = random_prompts([12, 20], seed=32)
    turn1 = drain(_add(engine, "turn1", first))["turn1"]
    assert turn1.final.context_version == 0
    prompt2 = first + turn1.tokens + new_tokens  # 37 tokens: 16 reused from turn 1, 21 to compute
    results: dict[str, Result] = {}
    _add(engine, "turn2", prompt2)
    _step(engine, results)  # the prefix hit plus one 16-token chunk, under v0
    engine.load_weights(_new_weights(tiny_moe), version=1)
    drain(engine, results)
    turn2 = results["turn2"]
    assert turn2.final.num_cached_tokens == 16
    assert turn2.versions == [1] * 5 and turn2.final.context_version == 0
    # The same turn sent after the update reuses nothing of v0's: it reports v1, what it used.
    again = drain(_add(engine, "again", prompt2))["again"]
    assert again.final.num_cached_tokens == 0 and again.final.context_version == 1


def test_preempted_after_an_update_still_reports_the_older_version(make_engine, tiny_moe):
    # 8 blocks of 4 for two sequences of up to 6 blocks each: the later one is preempted.
    engine = make_engine(kv_cache_tokens=32, max_model_len=32, max_num_batched_tokens=32)
    opts = SamplingOptions(temperature=0.0, max_tokens=16, ignore_eos=True)
    for rid, p in zip(("a", "b"), random_prompts([8, 8], seed=33)):
        engine.add_request(rid, p, opts)
    results: dict[str, Result] = {}
    for _ in range(3):
        _step(engine, results)
    engine.load_weights(_new_weights(tiny_moe), version=1)
    drain(engine, results)
    b = results["b"]
    assert engine.stats()["preemptions"] > 0
    assert b.versions[:3] == [0, 0, 0] and b.versions[-1] == 1
    # Recomputed under v1 after the preemption, yet its first tokens were sampled over v0's KV.
    assert b.final.context_version == 0


def _add(engine, rid: str, prompt: list[int]):
    engine.add_request(rid, prompt, GREEDY)
    return engine
