from asyncrl.inference.block_pool import BlockPool, hash_blocks


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
