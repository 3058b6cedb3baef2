"""Router policies: which replica of a cluster gets an arriving request.

The strategies Vidur and production load balancers offer: round-robin, random,
least outstanding requests (join the shortest queue) and least outstanding
tokens; power of two choices (Mitzenmacher); and prefix affinity, which sends
requests that share a prompt prefix to the same replica so that its prefix
cache holds it (as SGLang's cache-aware router does, by hashing), and
prefix-cache-aware routing that reads what each replica's cache holds (as
llm-d's precise scorer does, from KV events). A router sees
each replica through :class:`~testbed.core.routing.ReplicaView` (the interface,
with :class:`~testbed.core.routing.Router`, is the core's): the counts the
cluster keeps of what it sent each replica, and the KV usage the replica
reported at its last step, which is all a real load balancer sees too.
"""

from __future__ import annotations

import random
import struct
import zlib
from collections.abc import Sequence

from policies import import_class, is_class_path
from testbed.core.request import Request
from testbed.core.routing import ReplicaView, Router


class RoundRobin(Router):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, request: Request, replicas: Sequence[ReplicaView], now: float) -> int:
        i = self._next % len(replicas)
        self._next += 1
        return i


class RandomRouter(Router):
    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def choose(self, request: Request, replicas: Sequence[ReplicaView], now: float) -> int:
        return self.rng.randrange(len(replicas))


class LeastOutstanding(Router):
    """Join the replica with the fewest unfinished requests (ties: lowest index)."""

    name = "least_outstanding"

    def choose(self, request: Request, replicas: Sequence[ReplicaView], now: float) -> int:
        return min(replicas, key=lambda r: (r.num_outstanding, r.index)).index


class LeastOutstandingTokens(Router):
    """Join the replica with the fewest prompt tokens outstanding (ties: fewest
    requests, then lowest index): one long prompt weighs as much as many short."""

    name = "least_outstanding_tokens"

    def choose(self, request: Request, replicas: Sequence[ReplicaView], now: float) -> int:
        return min(
            replicas, key=lambda r: (r.num_outstanding_tokens, r.num_outstanding, r.index)
        ).index


class LeastKVUsage(Router):
    """The replica with the least KV usage (ties: fewest outstanding requests, then
    lowest index): the default pairing of a prefill leg's request with a decode
    instance in a disaggregated cluster, which must hold its prompt's KV."""

    name = "least_kv_usage"

    def choose(self, request: Request, replicas: Sequence[ReplicaView], now: float) -> int:
        return min(replicas, key=lambda r: (r.kv_usage, r.num_outstanding, r.index)).index


class PowerOfTwo(Router):
    """Two replicas drawn at random (seeded), the one with fewer outstanding
    requests (Mitzenmacher's power of two choices: nearly the balance of joining
    the shortest queue, from two probes)."""

    name = "power_of_two"

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def choose(self, request: Request, replicas: Sequence[ReplicaView], now: float) -> int:
        if len(replicas) < 2:
            return 0
        a, b = self.rng.sample(range(len(replicas)), 2)
        ra, rb = replicas[a], replicas[b]
        return a if (ra.num_outstanding, a) <= (rb.num_outstanding, b) else b


def prefix_key(request: Request, block_tokens: int, blocks: int) -> bytes | None:
    """What identifies a request's prompt prefix: its first ``blocks`` hash ids
    (a Mooncake-style trace), else its first ``blocks * block_tokens`` token ids;
    None for a length-only request, or a prompt shorter than one block."""
    if request.prefix_hash_ids:
        ids = list(request.prefix_hash_ids[:blocks])
    elif request.prompt_token_ids is not None and len(request.prompt_token_ids) >= block_tokens:
        n = min(len(request.prompt_token_ids), blocks * block_tokens)
        ids = list(request.prompt_token_ids[: n - n % block_tokens])
    else:
        return None
    return struct.pack(f"<{len(ids)}q", *ids)


class PrefixAffinity(Router):
    """Send requests with the same prompt prefix to the same replica: rendezvous
    hashing of the prefix's first blocks (:func:`prefix_key`) picks it, the same
    replica for a prefix while replicas come and go. Past an imbalance bound (the
    picked replica has more than ``(1 + imbalance)`` times the least loaded one's
    outstanding requests, plus ``slack``), or for a request without a known
    prefix, the least loaded replica instead."""

    name = "prefix_affinity"

    def __init__(
        self, block_tokens: int = 16, blocks: int = 1, imbalance: float = 0.5, slack: int = 4
    ) -> None:
        if block_tokens < 1 or blocks < 1 or imbalance < 0 or slack < 0:
            raise ValueError(
                "prefix_affinity: block_tokens and blocks must be >= 1, imbalance and "
                f"slack >= 0 (got {block_tokens}, {blocks}, {imbalance}, {slack})"
            )
        self.block_tokens, self.blocks = block_tokens, blocks
        self.imbalance, self.slack = imbalance, slack
        self.num_affine = self.num_fallback = 0  # choices by prefix, and otherwise

    def choose(self, request: Request, replicas: Sequence[ReplicaView], now: float) -> int:
        least = min(replicas, key=lambda r: (r.num_outstanding, r.index))
        key = prefix_key(request, self.block_tokens, self.blocks)
        if key is not None:
            seed = zlib.crc32(key)
            home = max(replicas, key=lambda r: zlib.crc32(struct.pack("<q", r.index), seed))
            bound = (1 + self.imbalance) * least.num_outstanding + self.slack
            if home.num_outstanding <= bound:
                self.num_affine += 1
                return home.index
        self.num_fallback += 1
        return least.index


class PrefixCacheAware(Router):
    """Send a request to the replica whose prefix cache holds the most of its prompt
    (as llm-d's precise prefix-cache scorer does, from the replicas' KV events;
    ties: fewest outstanding requests, then lowest index), unless that replica has
    more than ``(1 + imbalance)`` times the least loaded one's outstanding
    requests, plus ``slack``: then the least loaded. A request no cache holds
    any of goes to the least loaded replica."""

    name = "prefix_cache"
    reads_cache = True

    def __init__(self, imbalance: float = 0.5, slack: int = 4) -> None:
        if imbalance < 0 or slack < 0:
            raise ValueError(
                f"prefix_cache: imbalance and slack must be >= 0 (got {imbalance}, {slack})"
            )
        self.imbalance, self.slack = imbalance, slack
        self.num_affine = self.num_fallback = 0  # choices by cache, and otherwise

    def choose(self, request: Request, replicas: Sequence[ReplicaView], now: float) -> int:
        least = min(replicas, key=lambda r: (r.num_outstanding, r.index))
        bound = (1 + self.imbalance) * least.num_outstanding + self.slack
        best, best_hit = least, 0
        for r in replicas:
            if r.num_outstanding > bound:
                continue
            hit = r.prefix_hit_tokens(request)
            if hit > best_hit or (
                hit == best_hit
                and hit > 0
                and (r.num_outstanding, r.index) < (best.num_outstanding, best.index)
            ):
                best, best_hit = r, hit
        if best_hit > 0:
            self.num_affine += 1
        else:
            self.num_fallback += 1
        return best.index


ROUTERS = {
    cls.name: cls
    for cls in (
        RoundRobin,
        RandomRouter,
        LeastOutstanding,
        LeastOutstandingTokens,
        LeastKVUsage,
        PowerOfTwo,
        PrefixAffinity,
        PrefixCacheAware,
    )
}


def make_router(name: str, **kwargs) -> Router:
    """A bundled router by name, or your own by its class's path (``mypkg.mod:MyRouter``,
    a subclass of :class:`testbed.core.Router`)."""
    if is_class_path(name):
        return import_class(name, Router, "router")(**kwargs)
    if name not in ROUTERS:
        raise ValueError(f"unknown router {name!r}; known: {', '.join(sorted(ROUTERS))}")
    return ROUTERS[name](**kwargs)
