"""Which replicas' caches the cluster's decisions read (both modes ask the core)."""

from __future__ import annotations

from policies.deciders import make_decider
from policies.routers import make_router
from testbed.core.cluster import ClusterCore, caches_read


class Probe:
    kv_usage = 0.0

    def prefix_hit_tokens(self, request) -> int:
        return 0


def test_the_replicas_a_cache_reading_decision_looks_at_are_the_ones_stepped():
    cache, load = make_router("prefix_cache"), make_router("least_outstanding")
    pairing = make_router("least_kv_usage")
    assert caches_read(3, cache) == [True] * 3
    assert caches_read(3, load) == [False] * 3
    # 2P2D: the prefill router reads the prefill replicas, the decider the decode ones.
    assert caches_read(4, cache, 2, None, pairing) == [True, True, False, False]
    uncached = make_decider("uncached_prompt")
    assert caches_read(4, load, 2, uncached, pairing) == [False, False, True, True]
    core = ClusterCore([Probe()] * 4, cache, 2, None, pairing)
    assert [core.cut_by_delivery(i) for i in range(4)] == [False, False, True, True]
    core = ClusterCore([Probe()] * 4, load, 2, uncached, pairing)
    assert [core.cut_by_delivery(i) for i in range(4)] == [False] * 4
