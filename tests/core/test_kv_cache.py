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
    """Every token hashes alike, so every block's contents hash alike."""

    def __hash__(self) -> int:
        return 7


def test_blocks_whose_contents_hash_alike_are_told_apart():
    kv = KVCacheManager(num_blocks=16, block_size=2)
    toks = lambda xs: [CollidingToken(x) for x in xs]  # noqa: E731
    compute(kv, req("a", toks([1, 2, 3, 4, 5])), 5)
    hits, n = kv.get_computed_blocks(req("b", toks([1, 2, 9, 9, 5])))
    assert n == 2  # only the first block truly matches
    hits, n = kv.get_computed_blocks(req("c", toks([6, 6, 3, 4, 5])))
    assert n == 0


def test_blocks_are_findable_from_the_allocation_of_the_step_that_computes_them():
    """As in vLLM: a step writes its KV before any attention reads it, so the full
    blocks it computes are findable at once, by a request admitted later in it."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", list(range(10)))
    assert kv.allocate_slots(a, 6) is not None  # a chunk: one full block, one partial
    assert kv.get_computed_blocks(req("b", list(range(10))))[1] == 4
    a.num_computed_tokens = 6
    assert kv.allocate_slots(a, 4) is not None  # the rest: 10 tokens, two full blocks
    assert kv.get_computed_blocks(req("b", list(range(10))))[1] == 8
    # A decode step that fills the last block's last slot needs no new block,
    # and makes that block findable too.
    c = req("c", [5] * 7)
    compute(kv, c, 7)
    c.output_token_ids.append(5)
    assert kv.allocate_slots(c, 1) == []
    assert kv.get_computed_blocks(req("d", [5] * 9))[1] == 8


def test_a_request_preempted_after_its_allocation_takes_its_blocks_back():
    """Its step will not run, so the blocks registered for it hold no KV."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", list(range(12)))
    compute(kv, a, 4)  # block 0 computed in an earlier step
    assert kv.allocate_slots(a, 8) is not None  # blocks 1, 2 registered for this step
    assert kv.get_computed_blocks(req("b", list(range(12)) + [0]))[1] == 12
    kv.forget_uncomputed(a)
    kv.free(a)
    assert kv.get_computed_blocks(req("b", list(range(12)) + [0]))[1] == 4


def test_a_prefix_computed_twice_at_once_stays_findable_until_both_copies_go():
    """vLLM's block pool: both copies are findable under one key, a lookup gets
    the earliest, and the other takes over when it is evicted."""
    kv = KVCacheManager(num_blocks=6, block_size=2)
    a, b = req("a", [1, 2, 3]), req("b", [1, 2, 4])
    compute(kv, a, 3)
    compute(kv, b, 3)  # computed without a lookup: its own copy of [1, 2]
    first, second = kv.req_to_blocks["a"][0], kv.req_to_blocks["b"][0]
    assert kv.get_computed_blocks(req("x", [1, 2, 0]))[0] == [first]
    kv.free(a)
    kv.free(b)
    compute(kv, req("y", [7] * 9), 9)  # 5 blocks: the 4 uncached, then the oldest cached
    assert first.cache_key is None and second.cache_key is not None
    assert kv.get_computed_blocks(req("x", [1, 2, 0]))[0] == [second]
    compute(kv, req("z", [8]), 1)  # evicts the second copy
    assert kv.get_computed_blocks(req("x", [1, 2, 0]))[1] == 0
    assert not kv.pool.duplicates


def test_a_block_whose_parent_was_evicted_is_found_again_once_the_parent_is_recomputed():
    """Keys chain the prefix's contents, not the blocks that held it (as vLLM's
    block hashes)."""
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = req("a", [1, 2, 3, 4, 0])
    compute(kv, a, 5)
    parent, child = kv.req_to_blocks["a"][:2]
    kv.free(a)  # free pool: the partial block, then child, then parent (LRU)
    b = req("b", [1, 2, 9])
    hits, _ = kv.get_computed_blocks(b)
    compute(kv, b, 1, hits)  # touches the parent: it is now newer than the child
    kv.free(b)
    kv.pool.evict(parent)  # as if reallocated
    kv.pool.free_cached.pop(parent.block_id)
    kv.pool.free_uncached.append(parent)
    assert kv.get_computed_blocks(req("x", [1, 2, 3, 4, 0]))[1] == 0
    compute(kv, req("c", [1, 2, 5]), 3)  # computes [1, 2] again, in another block
    hits, n = kv.get_computed_blocks(req("x", [1, 2, 3, 4, 0]))
    assert n == 4 and hits[1] is child


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


def test_blocks_made_on_first_use_are_handed_out_as_a_full_free_stack_would():
    """The pool makes its blocks when first taken, in the order a stack of every
    block (lowest id on top) would hand them out, released blocks first."""
    import random

    from testbed.core.kv_cache import BlockPool

    rng = random.Random(3)
    pool = BlockPool(64)
    stack = list(range(64))[::-1]  # the eager pool's free stack, by id
    held = []
    for _ in range(400):
        if held and (rng.random() < 0.45 or len(stack) < 8):
            blocks = held.pop(rng.randrange(len(held)))
            pool.release(blocks)
            stack += [b.block_id for b in blocks]
        else:
            n = rng.randint(1, 8)
            got = pool.allocate(n)
            want = stack[len(stack) - n :]
            del stack[len(stack) - n :]
            assert [b.block_id for b in got] == want
            held.append(got)
        assert pool.num_free_blocks == len(stack)
    assert [b.block_id for b in pool.blocks] == list(range(64))
