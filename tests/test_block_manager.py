"""Prefix-caching block manager: hash-chain sharing, ref counts, LRU eviction, exactness on collisions."""

import pytest

from mla_compile.serving.block_manager import BlockManager


def test_common_prefix_shares_full_blocks_only():
    bm = BlockManager(16, 4)
    a_tokens = list(range(10))  # blocks [0-3] [4-7] [8-9]
    a = bm.allocate(a_tokens)
    assert a.cached_tokens == 0 and len(a.blocks) == 3
    bm.register(a, a_tokens)
    b_tokens = list(range(8)) + [99, 98, 97]
    b = bm.allocate(b_tokens)
    assert b.blocks[:2] == a.blocks[:2] and b.cached_tokens == 8
    assert b.blocks[2] not in a.blocks
    c = bm.allocate([1] + list(range(1, 10)))  # first block differs: nothing shared
    assert c.cached_tokens == 0 and not set(c.blocks) & set(a.blocks)


@pytest.mark.parametrize("length, cached", [(8, 4), (9, 8), (12, 8), (13, 12)])
def test_at_least_the_last_token_is_computed(length, cached):
    bm = BlockManager(16, 4)
    tokens = list(range(100, 100 + length))
    first = bm.allocate(tokens)
    bm.register(first, tokens)
    again = bm.allocate(tokens)
    assert again.cached_tokens == cached  # full blocks of tokens[:-1]


def test_ref_counts_and_lru_eviction_of_released_prefixes():
    bm = BlockManager(4, 2)
    t1 = [1, 2, 3, 4, 5]
    a = bm.allocate(t1)  # 3 blocks
    bm.register(a, t1)
    b = bm.allocate(t1)  # shares 2 full blocks, takes 1 new
    assert b.cached_tokens == 4 and bm.num_free == 0
    bm.free(a)
    assert bm.num_free == 1  # a's tail block; the shared ones are still held by b
    bm.free(b)
    assert bm.num_free == 4  # cached blocks are evictable, not lost
    c = bm.allocate(t1)  # still a hit after both finished
    assert c.cached_tokens == 4
    bm.free(c)
    d = bm.allocate([7, 7, 7, 7, 7, 7, 7])  # needs all 4 blocks: evicts the cached prefix
    assert len(d.blocks) == 4
    bm.free(d)
    assert bm.allocate(t1).cached_tokens == 0


def test_hash_collision_never_returns_another_prefix():
    bm = BlockManager(8, 2)
    a = bm.allocate([1, 2, 3])
    bm.register(a, [1, 2, 3])
    (h, bid), = bm.cached.items()
    bm.blocks[bid].key = (h, (5, 6))  # same hash, other tokens: must not be reused for [1, 2, ...]
    assert bm.allocate([1, 2, 9]).cached_tokens == 0


def test_full_cache_raises_without_changing_state():
    bm = BlockManager(3, 4)
    a = bm.allocate(list(range(9)))
    before = (list(bm.free_ids), dict(bm.cached), [b.ref for b in bm.blocks])
    with pytest.raises(RuntimeError, match="full"):
        bm.allocate([1, 2])
    assert before == (list(bm.free_ids), dict(bm.cached), [b.ref for b in bm.blocks])
    bm.free(a)
    assert bm.num_free == 3


def test_grow_and_disabled_prefix_caching():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    t = list(range(8))
    a = bm.allocate(t)
    bm.register(a, t)
    assert bm.allocate(t + [1]).cached_tokens == 0
    bm.grow(a, 13)
    assert len(a.blocks) == 4


def test_forget_makes_registered_blocks_unfindable_and_an_unheld_one_free():
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(100, 113))  # three full blocks and one token
    a = bm.allocate(tokens)
    made = bm.register(a, tokens)
    assert made == a.blocks[:3] and bm.register(a, tokens) == []  # already findable: nothing new
    keep = bm.allocate([7, 8, 9, 10, 11])
    kept = bm.register(keep, [7, 8, 9, 10, 11])
    bm.free(a)  # the three keyed blocks become evictable
    assert len(bm.evictable) == 3
    bm.forget(made[1:])
    assert len(bm.evictable) == 1 and bm.num_free == 8 - len(keep.blocks)
    assert bm.allocate(tokens).cached_tokens == 4  # only the first block still matches
    assert bm.allocate([7, 8, 9, 10, 11]).cached_tokens == 4 and kept  # other sequences' blocks untouched
