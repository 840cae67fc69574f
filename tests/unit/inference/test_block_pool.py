from asyncrl.inference.block_pool import BlockPool, hash_blocks
from asyncrl.inference.request import Request, SamplingOptions
from asyncrl.inference.scheduler import Scheduler


def test_hash_chain_depends_on_salt_and_whole_prefix():
    a = hash_blocks(list(range(12)), 4, None, [])
    assert len(a) == 3
    assert hash_blocks(list(range(12)), 4, "v1", []) != a
    b = hash_blocks([99, *range(1, 12)], 4, None, [])
    assert b[0] != a[0] and b[1] != a[1], "a change in block 0 must change every later hash"
    assert hash_blocks(list(range(12)), 4, None, a[:1]) == a  # extending a known chain


def test_prefix_match_refcounts_and_lru_eviction():
    pool = BlockPool(4)
    h = hash_blocks(list(range(8)), 4, None, [])
    blocks = pool.allocate(2)
    for b, hb in zip(blocks, h):
        pool.register(b, hb)
    assert pool.match_prefix(h) == blocks
    assert [pool.refcount[b] for b in blocks] == [2, 2]
    pool.release(blocks)
    pool.release(blocks)
    assert pool.num_free == 4 and pool.num_cached == 2
    # Two never-hashed blocks go first, then the LRU cached block (the tail, released first).
    fresh = pool.allocate(3)
    assert blocks[1] in fresh and blocks[0] not in fresh
    assert pool.match_prefix(h) == [blocks[0]]
    assert pool.allocate(1) is None


def test_other_salt_never_matches():
    pool = BlockPool(2)
    h = hash_blocks(list(range(4)), 4, "a", [])
    (b,) = pool.allocate(1)
    pool.register(b, h[0])
    assert pool.match_prefix(hash_blocks(list(range(4)), 4, "b", [])) == []
    assert pool.match_prefix(h) == [b]


def test_a_prefix_hit_takes_on_the_oldest_kv_version_of_the_blocks_it_reuses():
    sched = Scheduler(BlockPool(8), block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    first = Request(request_id="a", prompt_token_ids=list(range(9)), options=SamplingOptions())
    sched.add(first)
    (run,) = sched.schedule()
    first.note_kv_version(3)  # the engine ran this step under version 3
    sched.commit(first, run.num_new_tokens)  # blocks 0 and 1 are cached, recorded as version 3
    sched.remove(first)
    second = Request(request_id="b", prompt_token_ids=[*range(9), 42], options=SamplingOptions())
    sched.add(second)
    sched.schedule()
    assert second.num_computed_tokens == 8 and second.context_version == 3
    second.note_kv_version(5)  # later steps under newer weights never make it newer
    assert second.context_version == 3
