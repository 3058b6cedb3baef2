"""Router policies: which replica of a cluster gets an arriving request.

The strategies Vidur and production load balancers offer: round-robin, random,
and least outstanding requests (join the shortest queue). A router sees each
replica through :class:`ReplicaView`; in the simulator those counts are the
ones at the replica's last event (arrivals, admissions, completions), which is
all a real load balancer sees too.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

from testbed.core.request import Request


class ReplicaView(Protocol):
    index: int

    @property
    def num_outstanding(self) -> int:
        """Requests routed to the replica and not finished."""
        ...


class Router:
    """Base class: pick a replica index for ``request``."""

    name = "base"

    def choose(self, request: Request, replicas: Sequence[ReplicaView], now: float) -> int:
        raise NotImplementedError


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


ROUTERS = {cls.name: cls for cls in (RoundRobin, RandomRouter, LeastOutstanding)}


def make_router(name: str, **kwargs) -> Router:
    if name not in ROUTERS:
        raise ValueError(f"unknown router {name!r}; known: {', '.join(sorted(ROUTERS))}")
    return ROUTERS[name](**kwargs)
