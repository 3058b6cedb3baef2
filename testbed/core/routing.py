"""The cluster-level policy API a researcher implements, beside :class:`Policy`:
a :class:`Router` picks the replica of a pool that gets a request, a
:class:`Decider` says whether a disaggregated cluster computes a prompt on a
prefill replica and moves its KV, and :class:`ReplicaView` is what both see of a
replica. The cluster core (:mod:`testbed.core.cluster`) asks them in both modes;
the bundled implementations live in ``policies/routers.py`` and
``policies/deciders.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from testbed.core.request import Request


class ReplicaView(Protocol):
    """A replica as a router sees it: its place in the pool it is asked about, what
    the cluster sent it, and what it reported of its KV cache."""

    index: int  # its place in the pool the router chooses from

    @property
    def num_outstanding(self) -> int:
        """Requests routed to the replica and not finished."""
        ...

    @property
    def num_outstanding_tokens(self) -> int:
        """Prompt tokens of the requests routed to the replica and not finished (the
        prefill work and KV they bring)."""
        ...

    @property
    def kv_usage(self) -> float:
        """The fraction of its KV blocks in use (as of its last step)."""
        ...

    def prefix_hit_tokens(self, request: Request) -> int:
        """Tokens of ``request``'s prompt its prefix cache holds (as of its last
        step). Only for a router or decider that declares ``reads_cache``: the
        simulator then steps the replica without jumps, and the real cluster has
        its workers report their cache's blocks."""
        ...


class Router:
    """Base class: pick a replica index (its place in ``replicas``) for ``request``."""

    name = "base"
    reads_cache = False  # whether choose() calls prefix_hit_tokens()

    def choose(self, request: Request, replicas: Sequence[ReplicaView], now: float) -> int:
        raise NotImplementedError

    def route(self, request: Request, replicas: Sequence[ReplicaView], now: float) -> int:
        """:meth:`choose`, where there is a choice (one replica: it)."""
        return 0 if len(replicas) == 1 else self.choose(request, replicas, now)


class Decider:
    """Base class: True to disaggregate ``request``, whose prompt has
    ``uncached_tokens`` tokens the decode replica it would go to does not hold."""

    name = "base"
    reads_cache = False  # whether uncached_tokens must be looked up

    def disaggregate(self, request: Request, uncached_tokens: int) -> bool:
        raise NotImplementedError
