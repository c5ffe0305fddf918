"""BlockManager: allocation, ref counts, prefix reuse, eviction; a leak check after each test."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager, NoFreeBlocksError, prefix_block_hashes


@pytest.fixture
def pool():
    bm = BlockManager(num_blocks=8, block_size=4)
    yield bm
    assert bm.num_free == bm.num_total, "blocks leaked"


def test_allocate_and_free_return_every_block(pool):
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert len(set(a + b)) == 8 and pool.num_free == 0
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    pool.free(a)
    pool.free(b)


def test_double_free_is_an_error(pool):
    a = pool.allocate(1)
    pool.free(a)
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(a)


def test_append_slots_grows_only_at_block_boundaries(pool):
    table = pool.allocate(1)
    pool.append_slots(table, 4)
    assert len(table) == 1
    pool.append_slots(table, 5)
    assert len(table) == 2
    pool.free(table)


def _compute(pool, tokens):
    """Allocate for ``tokens`` as the scheduler does and publish the computed full blocks."""
    table, cached = pool.allocate_for_tokens(tokens, len(tokens))
    hashes: list[bytes] = []
    pool.cache_full_blocks(table, hashes, tokens, len(tokens))
    return table, cached


def test_shared_prefix_reuses_cached_blocks_with_refcounts(pool):
    system = list(range(100, 108))  # two full blocks
    t1, c1 = _compute(pool, system + [1, 2, 3])
    t2, c2 = _compute(pool, system + [7, 8])
    assert c1 == 0 and c2 == 8
    assert t1[:2] == t2[:2] and t1[2] != t2[2]
    assert pool.ref_count(t1[0]) == 2
    assert pool.prefix_hit_tokens == 8
    pool.free(t1)
    pool.free(t2)


def test_freed_blocks_stay_cached_until_reused(pool):
    tokens = list(range(9))
    t1, _ = _compute(pool, tokens)
    pool.free(t1)
    assert pool.num_free == pool.num_total
    t2, cached = _compute(pool, tokens)
    assert cached == 8 and t2[:2] == t1[:2]
    pool.free(t2)


def test_last_token_block_is_never_taken_from_cache(pool):
    tokens = list(range(8))  # exactly two full blocks
    t1, _ = _compute(pool, tokens)
    t2, cached = _compute(pool, tokens)
    assert cached == 4, "the block holding the last prompt token must be recomputed"
    pool.free(t1)
    pool.free(t2)


def test_eviction_forgets_hashes(pool):
    t1, _ = _compute(pool, list(range(8)))
    pool.free(t1)
    everything = pool.allocate(8)  # takes cached blocks for new content
    pool.free(everything)
    t2, cached = _compute(pool, list(range(9)))
    assert cached == 0
    pool.free(t2)


def test_prefix_hashes_chain_on_the_whole_prefix():
    a = prefix_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = prefix_block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[1] != b[1], "equal second blocks after different first blocks"


def test_prefix_caching_can_be_disabled():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    t1, _ = _compute(bm, list(range(9)))
    t2, cached = _compute(bm, list(range(9)))
    assert cached == 0
    bm.free(t1)
    bm.free(t2)
    assert bm.num_free == bm.num_total
