"""Paged KV-cache bookkeeping: blocks, the block pool and the KV-cache manager.

The KV cache is cut into fixed-size blocks of ``block_size`` token slots. A
request owns a list of blocks (its block table); blocks shared through the
prefix cache are reference-counted.

Prefix caching works on full blocks, with vLLM V1's semantics. A cached block
is found by the key ``(parent_hash, content)``: ``content`` is the block's own
tokens (see :meth:`Request.block_content`), compared by equality, and
``parent_hash`` chains the keys of all blocks before it (the hash of the
previous block's key; :data:`ROOT_HASH` for the first), so a key stands for
the whole prefix (as vLLM's block hashes do; two prefixes whose 64-bit chain
hashes collide could share a block). A block is findable from the moment it is
allocated for tokens computed in this step, since the engine writes a step's
KV before any attention reads it: a request admitted later in the same step
already hits it. Two requests that computed the same prefix at once each keep
their block findable under the same key; a lookup gets the earliest
registered, and the next one takes over when it is evicted.

Freed blocks go to a free pool: blocks without cached contents are reused
first (the most recently freed first); cached blocks stay findable and are
evicted least-recently-used, lazily, only when a block is reallocated.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from testbed.core.request import Request

ROOT_HASH = 0  # the parent hash of a request's first block
_EMPTY: list = []  # stands for "no blocks yet"; never mutated
_NO_NEW_BLOCKS: list[int] = []  # allocate_slots' answer when no block was added; never mutated


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheBlock:
    """One block of KV slots. ``cache_key`` is set while its contents are findable."""

    __slots__ = ("block_id", "cache_key", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.cache_key: tuple[int, Hashable] | None = None

    def __repr__(self) -> str:
        cached = self.cache_key is not None
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, cached={cached})"


class BlockPool:
    """All blocks, the free pool and the map from cache key to cached block."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self._num_blocks = num_blocks
        # Free blocks without findable contents, used as a stack (any is as good
        # as another; a stack hands them out in slices). Its bottom is the blocks
        # never handed out, ``_fresh`` and up (the lowest on top), made only when
        # first taken: a large cache costs nothing until it is used.
        self.free_uncached: list[KVCacheBlock] = []
        self._fresh = 0
        self._made: list[KVCacheBlock] = []  # every block made so far, by id
        # Free blocks whose contents are still findable, oldest-freed first.
        self.free_cached: OrderedDict[int, KVCacheBlock] = OrderedDict()
        # The block a lookup gets for each key: the earliest registered of its blocks.
        self.cached: dict[tuple[int, Hashable], KVCacheBlock] = {}
        # Keys held by several blocks: all of them, in registration order.
        self.duplicates: dict[tuple[int, Hashable], dict[int, KVCacheBlock]] = {}
        self._num_registered = 0
        self.num_evictions = 0
        # When a list: every key made findable (True) or no longer findable (False),
        # by its chain hash, in order (vLLM's KV events: a router mirrors a cache).
        self.events: list[tuple[bool, int]] | None = None

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_uncached) + self._num_blocks - self._fresh + len(self.free_cached)

    @property
    def blocks(self) -> list[KVCacheBlock]:
        """Every block, by id (made now if never taken yet; for inspection)."""
        self._make(self._num_blocks)
        return self._made

    @property
    def never_used(self) -> range:
        """The ids of the free blocks never handed out (below the free stack)."""
        return range(self._fresh, self._num_blocks)

    def _make(self, end: int) -> None:
        made = self._made
        made.extend(KVCacheBlock(i) for i in range(len(made), end))

    def allocate(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` free blocks (the caller has checked there are enough):
        blocks without cached contents first, then the least recently freed."""
        free = self.free_uncached
        k = len(free)
        if n <= k:
            out = free[k - n :]
            del free[k - n :]
            take = n
        else:
            out, take = free[:], k
            free.clear()
            start = self._fresh
            end = start + n - k
            if end > self._num_blocks:
                end = self._num_blocks
            if end > start:  # below the stack's released blocks: before them in the slice
                self._fresh = end
                if len(self._made) < end:
                    self._make(end)
                out = self._made[end - 1 : start - 1 if start else None : -1] + out
                take += end - start
        for _ in range(n - take):
            _, block = self.free_cached.popitem(last=False)
            self.evict(block)
            out.append(block)
        for block in out:
            block.ref_cnt = 1
        return out

    @property
    def num_registered(self) -> int:
        """Blocks made findable so far (only grows)."""
        return self._num_registered

    def evict(self, block: KVCacheBlock) -> None:
        """Make a block's contents unfindable (it is reused for others)."""
        self.unregister(block)
        self.num_evictions += 1

    def unregister(self, block: KVCacheBlock) -> None:
        """Take ``block`` out of the cache; another block with its key takes over."""
        key = block.cache_key
        block.cache_key = None
        holders = self.duplicates.get(key)
        if holders is None:
            del self.cached[key]
            if self.events is not None:
                self.events.append((False, hash(key)))
            return
        del holders[block.block_id]
        if self.cached[key] is block:
            self.cached[key] = next(iter(holders.values()))
        if len(holders) == 1:
            del self.duplicates[key]

    def touch(self, block: KVCacheBlock) -> None:
        """Take a reference to a cached block found by a prefix hit."""
        if block.ref_cnt == 0:
            del self.free_cached[block.block_id]
        block.ref_cnt += 1

    def release(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Drop one reference to each block, in the order given (evicted last first)."""
        to_stack, cached = self.free_uncached.append, self.free_cached
        for block in blocks:
            n = block.ref_cnt = block.ref_cnt - 1
            if n == 0:
                if block.cache_key is None:
                    to_stack(block)
                else:
                    cached[block.block_id] = block
            elif n < 0:
                raise AssertionError(f"{block} freed twice")

    def register(self, block: KVCacheBlock, key: tuple[int, Hashable]) -> None:
        """Make ``block`` findable under ``key``. If other blocks hold the same key
        (requests that computed one prefix at once), a lookup still gets the
        earliest; this one takes over when the ones before it are evicted."""
        block.cache_key = key
        self._num_registered += 1
        existing = self.cached.setdefault(key, block)
        if existing is block:
            if self.events is not None:
                self.events.append((True, hash(key)))
        else:
            holders = self.duplicates.get(key)
            if holders is None:
                holders = self.duplicates[key] = {existing.block_id: existing}
            holders[block.block_id] = block

    def lookup(self, key: tuple[int, Hashable]) -> KVCacheBlock | None:
        return self.cached.get(key)

    def forget_free_cached(self) -> None:
        """Evict every free block's cached contents."""
        for block in list(self.free_cached.values()):
            self.evict(block)
            self.free_uncached.append(block)
        self.free_cached.clear()


def block_hashes(request: Request, block_size: int) -> Iterator[int]:
    """The chain hashes of ``request``'s leading full blocks that a prefix cache can
    hold (never the block of its last token, as :meth:`KVCacheManager
    .get_computed_blocks` counts), up to the first whose contents are unknown."""
    parent = ROOT_HASH
    for i in range((request.num_tokens - 1) // block_size):
        content = request.block_content(i, block_size)
        if content is None:
            return
        parent = hash((parent, content))
        yield parent


class PrefixCacheMirror:
    """What another process knows of a prefix cache from its events
    (:meth:`KVCacheManager.take_events`): the chain hashes findable there, and so how much
    of a request's prompt it holds, as :meth:`KVCacheManager.get_computed_blocks`
    counts it (up to a collision of 64-bit hashes)."""

    def __init__(self, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size, self.enabled = block_size, enable_prefix_caching
        self.hashes: set[int] = set()

    def apply(self, events: Sequence[tuple[bool, int]]) -> None:
        for stored, h in events:
            if stored:
                self.hashes.add(h)
            else:
                self.hashes.discard(h)

    def prefix_hit_tokens(self, request: Request) -> int:
        if not self.enabled:
            return 0
        n = 0
        for h in block_hashes(request, self.block_size):
            if h not in self.hashes:
                break
            n += 1
        return n * self.block_size


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """Counts in tokens over admitted requests (first admissions and resumptions),
    as the manager recorded them (:meth:`KVCacheManager.record_admission`)."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Allocates KV slots for requests, with hash-chained prefix caching.

    The scheduler's interface (all of it: ``KVCacheInterface`` in
    :mod:`testbed.core.scheduler_interface`): :meth:`get_computed_blocks` for a
    waiting request's prefix hit, :meth:`record_admission` once it is admitted,
    :meth:`allocate_slots` before every scheduled step of a request (``None``
    means no room: the scheduler's signal to preempt; the full blocks the step
    will compute become findable at once), and :meth:`free` when a request
    finishes or is preempted.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Per request: the chain hash of each of its leading blocks that are
        # findable (its own or hits); the last is the next block's parent hash.
        self.req_to_chain: dict[str, list[int]] = {}
        # Requests whose next block's contents are unknown for good (a
        # length-only prompt ends there): nothing more of theirs is cacheable.
        self._chain_closed: set[str] = set()
        self._num_queried_tokens = 0
        self._num_hit_tokens = 0

    # --- queries ---
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (free cached blocks count as free)."""
        return (self.pool.num_blocks - self.pool.num_free_blocks) / self.pool.num_blocks

    @property
    def num_registered(self) -> int:
        """Blocks made findable so far (only grows): when it grows, a waiting
        request may hit more of its prefix in the cache and need fewer blocks."""
        return self.pool.num_registered

    @property
    def stats(self) -> PrefixCacheStats:
        """Prefix-cache queries and hits so far, in tokens, over admitted requests."""
        return PrefixCacheStats(self._num_queried_tokens, self._num_hit_tokens)

    def record_admission(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count an admitted request's lookup (a first admission or a resumption):
        ``num_tokens`` asked for, ``num_hit_tokens`` of them found in the cache."""
        self._num_queried_tokens += num_tokens
        self._num_hit_tokens += num_hit_tokens

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    @property
    def block_tables(self) -> Mapping[str, Sequence[KVCacheBlock]]:
        """Each request's blocks, by request id; read-only (the fast path counts them)."""
        return self.req_to_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _match_prefix(self, request: Request) -> list[KVCacheBlock]:
        # Never the whole prompt: the last token must be computed to sample from.
        max_blocks = (request.num_tokens - 1) // self.block_size
        lookup, content = self.pool.lookup, request.block_content
        parent, hits = ROOT_HASH, []
        for i in range(max_blocks):
            c = content(i, self.block_size)
            if c is None:
                break
            key = (parent, c)
            block = lookup(key)
            if block is None:
                break
            hits.append(block)
            parent = hash(key)
        return hits

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Cached blocks holding a prefix of the request, and how many tokens they cover.

        Read-only: the blocks are referenced only by :meth:`allocate_slots`, and
        the caller records the query (:meth:`record_admission`) if it admits the
        request.
        """
        if not self.enable_prefix_caching:
            return [], 0
        hits = self._match_prefix(request)
        return hits, len(hits) * self.block_size

    # --- allocation ---
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_lookahead_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        delay_cache_blocks: bool = False,
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` (+ lookahead) after the computed tokens,
        and make the full blocks they complete findable.

        ``new_computed_blocks`` are prefix hits from :meth:`get_computed_blocks`
        for a request being admitted. With ``full_sequence_must_fit`` (an
        admission), the free pool must also hold all the request's tokens, not
        just this step's. With ``delay_cache_blocks`` (KV that arrives from another
        instance), nothing is made findable: :meth:`cache_blocks` once it has
        arrived. Returns the ids of newly allocated blocks (possibly
        empty), or None, changing nothing, when the free pool is too small.
        """
        req_id = request.request_id
        blocks = self.req_to_blocks.get(req_id, _EMPTY)
        bs = self.block_size
        computed = request.num_computed_tokens
        if not new_computed_blocks and (
            computed + num_new_tokens + num_lookahead_tokens <= len(blocks) * bs
        ):
            # The common decode step: the last block has room (and may fill up).
            end = computed + num_new_tokens
            if (
                self.enable_prefix_caching
                and end // bs > computed // bs
                and req_id not in self._chain_closed
            ):
                self.cache_blocks(request, min(end, request.num_tokens))
            return _NO_NEW_BLOCKS
        num_hit = len(new_computed_blocks)
        num_computed = computed + num_hit * bs
        held = len(blocks) + num_hit
        pool = self.pool
        num_free = len(pool.free_uncached) + pool._num_blocks - pool._fresh + len(pool.free_cached)
        if new_computed_blocks:
            # Hit blocks that sit in the free pool leave it when referenced.
            num_free -= sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if full_sequence_must_fit and cdiv(request.num_tokens, bs) - held > num_free:
            return None
        num_required = -(-(num_computed + num_new_tokens + num_lookahead_tokens) // bs)
        num_new_blocks = num_required - held
        if num_new_blocks > num_free:
            return None
        if blocks is _EMPTY:
            blocks = self.req_to_blocks[req_id] = []
            self.req_to_chain[req_id] = []
        if new_computed_blocks:
            chain = self.req_to_chain[req_id]
            for b in new_computed_blocks:
                self.pool.touch(b)
                blocks.append(b)
                chain.append(hash(b.cache_key))
        new_ids: list[int] = []
        if num_new_blocks > 0:
            new_blocks = self.pool.allocate(num_new_blocks)
            blocks.extend(new_blocks)
            new_ids = [b.block_id for b in new_blocks]
        end = num_computed + num_new_tokens
        if (
            self.enable_prefix_caching
            and end >= bs
            and req_id not in self._chain_closed
            and not delay_cache_blocks
        ):
            self.cache_blocks(request, min(end, request.num_tokens))
        return new_ids

    def cache_blocks(self, request: Request, num_tokens: int | None = None) -> None:
        """Make the request's full blocks among its first ``num_tokens`` tokens
        (default: its computed ones) findable by later requests.

        :meth:`allocate_slots` calls it for the tokens a step will compute: the
        engine writes a step's KV before attention reads any, so a request
        scheduled later in the same step may read them. A request preempted
        before its step runs takes them back (:meth:`forget_uncomputed`).
        """
        rid = request.request_id
        chain = self.req_to_chain.get(rid)
        if chain is None:
            return
        if num_tokens is None:
            num_tokens = request.num_computed_tokens
        num_full = num_tokens // self.block_size
        if num_full <= len(chain) or not self.enable_prefix_caching or rid in self._chain_closed:
            return
        blocks = self.req_to_blocks[rid]
        register, content = self.pool.register, request.block_content
        parent = chain[-1] if chain else ROOT_HASH
        for i in range(len(chain), num_full):
            c = content(i, self.block_size)
            if c is None:
                # Known tokens of a prompt with ids are all known, so None means
                # contents that no later step will reveal.
                self._chain_closed.add(rid)
                return
            key = (parent, c)
            register(blocks[i], key)
            parent = hash(key)
            chain.append(parent)

    def forget_uncomputed(self, request: Request) -> None:
        """Unfind the blocks registered for a step that will not run for
        ``request`` (preempted after it was scheduled): their KV is never written."""
        chain = self.req_to_chain.get(request.request_id)
        if not chain:
            return
        start = request.num_computed_tokens // self.block_size
        blocks = self.req_to_blocks[request.request_id]
        for block in blocks[start : len(chain)]:
            if block.cache_key is not None:
                self.pool.unregister(block)
        del chain[start:]

    def free(self, request: Request) -> None:
        """Release the request's blocks (tail first, so shared heads are evicted last)."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.req_to_chain.pop(request.request_id, None)
        self._chain_closed.discard(request.request_id)
        if blocks:
            self.pool.release(blocks[::-1])

    def reset_prefix_cache(self) -> None:
        """Forget all cached contents of free blocks (e.g. between experiments)."""
        self.pool.forget_free_cached()

    # --- KV events (vLLM's ``kv_events``): what another process mirrors ---
    def record_events(self) -> None:
        """From now on, record every key the prefix cache makes findable or drops."""
        if self.pool.events is None:
            self.pool.events = []

    def take_events(self) -> list[tuple[bool, int]]:
        """The recorded events since the last call ((made findable, chain hash), in
        order; :class:`PrefixCacheMirror` applies them), and forget them."""
        events = self.pool.events
        if not events:
            return []
        self.pool.events = []
        return events

    @property
    def has_events(self) -> bool:
        """Whether events are recorded and not yet taken."""
        return bool(self.pool.events)
