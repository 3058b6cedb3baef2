"""The block pool and KV-cache manager, decision by decision."""

from __future__ import annotations

import pytest

from testbed.core import KVCacheManager, Request


def req(rid: str, tokens: list[int], computed: int = 0) -> Request:
    r = Request(request_id=rid, prompt_token_ids=tokens)
    r.num_computed_tokens = computed
    return r


def compute(kv: KVCacheManager, r: Request, n: int, hits=()) -> list[int]:
    """Allocate n tokens after the hit, pretend the step ran, cache full blocks."""
    ids = kv.allocate_slots(r, n, hits)
    assert ids is not None
    r.num_computed_tokens += len(hits) * kv.block_size + n
    kv.cache_blocks(r)
    return ids


def test_allocate_and_free_round_trip():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = req("a", list(range(10)))
    ids = kv.allocate_slots(r, 10)
    assert len(ids) == 3 and kv.num_free_blocks == 5
    assert kv.get_block_ids("a") == ids
    assert all(kv.pool.blocks[i].ref_cnt == 1 for i in ids)
    kv.free(r)
    assert kv.num_free_blocks == 8 and kv.get_block_ids("a") == []
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = req("a", list(range(8)))
    compute(kv, a, 8)
    b = req("b", list(range(8)) + [99] * 8)
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    before = ([bl.ref_cnt for bl in kv.pool.blocks], kv.num_free_blocks, dict(kv.req_to_blocks))
    # b needs 2 more blocks for its 8 new tokens plus 4 lookahead: 3 > 2 free.
    assert kv.allocate_slots(b, 8, hits, num_lookahead_tokens=4) is None
    after = ([bl.ref_cnt for bl in kv.pool.blocks], kv.num_free_blocks, dict(kv.req_to_blocks))
    assert before[:2] == after[:2]
    assert kv.get_block_ids("b") == []
    assert kv.allocate_slots(b, 8, hits) is not None  # without lookahead it fits


def test_prefix_hit_shares_blocks_and_never_covers_whole_prompt():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = req("a", list(range(8)))
    compute(kv, a, 8)
    b = req("b", list(range(8)))  # identical prompt: the last token must be recomputed
    hits, n = kv.get_computed_blocks(b)
    assert n == 4 and [h.block_id for h in hits] == kv.get_block_ids("a")[:1]
    c = req("c", list(range(8)) + [7, 7])
    hits, n = kv.get_computed_blocks(c)
    assert n == 8
    compute(kv, c, 2, hits)
    shared = kv.get_block_ids("a")
    assert kv.get_block_ids("c")[:2] == shared
    assert [kv.pool.blocks[i].ref_cnt for i in shared] == [2, 2]


def test_hit_requires_the_whole_prefix_to_match():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    compute(kv, req("a", [1, 2, 3, 4, 5, 6, 7, 8, 0]), 9)
    # Same second block, different first block: no hit at all.
    hits, n = kv.get_computed_blocks(req("b", [9, 9, 9, 9, 5, 6, 7, 8, 0]))
    assert n == 0 and hits == []


class CollidingToken(int):
    """Every token hashes alike, so every block's key hashes alike."""

    def __hash__(self) -> int:
        return 7


def test_hash_collisions_never_give_a_false_hit():
    kv = KVCacheManager(num_blocks=16, block_size=2)
    toks = lambda xs: [CollidingToken(x) for x in xs]  # noqa: E731
    compute(kv, req("a", toks([1, 2, 3, 4, 5])), 5)
    hits, n = kv.get_computed_blocks(req("b", toks([1, 2, 9, 9, 5])))
    assert n == 2  # only the first block truly matches
    hits, n = kv.get_computed_blocks(req("c", toks([6, 6, 3, 4, 5])))
    assert n == 0


def test_blocks_become_findable_only_once_computed():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", list(range(9)))
    assert kv.allocate_slots(a, 9) is not None  # allocated, not yet computed
    assert kv.get_computed_blocks(req("b", list(range(9))))[1] == 0
    a.num_computed_tokens = 9
    kv.cache_blocks(a)
    assert kv.get_computed_blocks(req("b", list(range(9))))[1] == 8


def test_free_queue_reuses_uncached_first_and_evicts_lru_lazily():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    old = req("old", [1, 2, 3])
    compute(kv, old, 3)  # block 0 cached ([1, 2]), block 1 partial
    new = req("new", [5, 6, 7])
    compute(kv, new, 3)  # block 2 cached ([5, 6]), block 3 partial
    kv.free(old)
    kv.free(new)
    assert kv.num_free_blocks == 4
    # Freed, but still findable until reallocated (lazy eviction).
    assert kv.get_computed_blocks(req("x", [1, 2, 0]))[1] == 2
    # Two new blocks come from the uncached ones; both cached prefixes survive.
    compute(kv, req("y", [8, 8, 8]), 3)
    assert kv.get_computed_blocks(req("x", [1, 2, 0]))[1] == 2
    assert kv.get_computed_blocks(req("x", [5, 6, 0]))[1] == 2
    # One more block evicts the least recently freed cached block ("old").
    compute(kv, req("z", [9]), 1)
    assert kv.get_computed_blocks(req("x", [1, 2, 0]))[1] == 0
    assert kv.get_computed_blocks(req("x", [5, 6, 0]))[1] == 2
    assert kv.pool.num_evictions == 1


def test_hit_on_a_free_cached_block_takes_it_out_of_the_free_pool():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a = req("a", [1, 2, 3])
    compute(kv, a, 3)
    kv.free(a)
    b = req("b", [1, 2, 4])
    hits, n = kv.get_computed_blocks(b)
    compute(kv, b, 1, hits)
    assert kv.num_free_blocks == 1
    assert kv.pool.blocks[hits[0].block_id].ref_cnt == 1


def test_length_only_prompts_share_through_prefix_hash_ids():
    kv = KVCacheManager(num_blocks=64, block_size=16)
    mk = lambda rid, hashes, n: Request(  # noqa: E731
        request_id=rid, num_prompt_tokens=n, prefix_hash_ids=hashes, hash_block_tokens=64
    )
    a = mk("a", [11, 12], 128)
    compute(kv, a, 128)
    hits, n = kv.get_computed_blocks(mk("b", [11, 13], 130))
    assert n == 64  # the first hash block (4 blocks of 16) is shared
    hits, n = kv.get_computed_blocks(mk("c", None, 130))
    assert n == 0  # no hash ids: contents unknown, never shared


def test_usage_and_prefix_caching_off():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    a = req("a", list(range(8)))
    compute(kv, a, 8)
    assert kv.usage == pytest.approx(0.2)
    assert kv.get_computed_blocks(req("b", list(range(9))))[1] == 0
    kv.free(a)
    assert kv.usage == 0.0


def test_double_free_of_a_block_is_caught():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    a = req("a", [1])
    kv.allocate_slots(a, 1)
    block = kv.req_to_blocks["a"][0]
    kv.free(a)
    with pytest.raises(AssertionError, match="freed twice"):
        kv.pool.release([block])
