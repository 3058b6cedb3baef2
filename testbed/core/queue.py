"""Waiting queues, each kept in its policy's order: one class per kind of key
behind one interface, chosen from the policy by :func:`create_waiting_queue`.

* :class:`SortedQueue`: a static key (``policy.dynamic_key`` false); the queue
  stays sorted as requests enter, so reading it costs nothing;
* :class:`ResortedQueue`: a dynamic key; sorted by it when read;
* :class:`GroupedQueue`: a dynamic key whose policy groups its requests
  (:meth:`Policy.group_of`): each group stays sorted by
  ``policy.order_in_group``, a read merges the groups ranking only their heads
  by ``key``, and a request moves group at ``policy.regroup_at``.

Ties go to the earlier arrival (``arrival_seq``) in all three.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from bisect import bisect_left, insort
from collections.abc import Hashable, Iterable, Iterator
from itertools import count

from testbed.core.policy import Policy, overrides
from testbed.core.request import Request


class WaitingQueue(ABC):
    """Requests waiting for admission, served in ``policy.key`` order."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy

    @abstractmethod
    def __len__(self) -> int: ...

    def __bool__(self) -> bool:
        return len(self) > 0

    @abstractmethod
    def add(self, request: Request, now: float) -> None:
        """Queue ``request`` (new, or back after a preemption)."""

    @abstractmethod
    def candidates(self, now: float) -> Iterator[tuple[object, Request]]:
        """Yield ``(position, request)``, most urgent first, lazily.

        The queue must not change while this runs; remove what was taken
        afterwards with :meth:`remove_positions`.
        """

    @abstractmethod
    def peek(self, now: float) -> Request | None:
        """The most urgent request, or None when the queue is empty."""

    @abstractmethod
    def remove_positions(self, positions: Iterable[object]) -> None:
        """Remove the requests at these positions (as yielded by :meth:`candidates`)."""

    @abstractmethod
    def remove(self, request: Request) -> None:
        """Remove ``request`` (``KeyError`` when it is not waiting)."""


class _ListQueue(WaitingQueue):
    """A queue in one list whose positions are list indices (the sorted and the
    resorted queue); ``_request`` reads the request out of an entry."""

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        self._items: list = []

    def __len__(self) -> int:
        return len(self._items)

    @staticmethod
    def _request(entry) -> Request:
        return entry

    def remove_positions(self, positions: Iterable[object]) -> None:
        for pos in sorted(positions, reverse=True):
            del self._items[pos]

    def remove(self, request: Request) -> None:
        for pos, entry in enumerate(self._items):
            if self._request(entry) is request:
                del self._items[pos]
                return
        raise KeyError(request.request_id)


class SortedQueue(_ListQueue):
    """A static key: kept sorted as ``(key, arrival_seq, request)`` entries."""

    @staticmethod
    def _request(entry) -> Request:
        return entry[2]

    def add(self, request: Request, now: float) -> None:
        insort(self._items, (self.policy.key(request, now), request.arrival_seq, request))

    def candidates(self, now: float) -> Iterator[tuple[object, Request]]:
        items = self._items
        for pos in range(len(items)):
            yield pos, items[pos][2]

    def peek(self, now: float) -> Request | None:
        return self._items[0][2] if self._items else None


class ResortedQueue(_ListQueue):
    """A dynamic key: requests in arrival order, sorted by the key when read."""

    def add(self, request: Request, now: float) -> None:
        self._items.append(request)

    def candidates(self, now: float) -> Iterator[tuple[object, Request]]:
        key = self.policy.key
        self._items.sort(key=lambda r: (key(r, now), r.arrival_seq))
        yield from enumerate(self._items)

    def peek(self, now: float) -> Request | None:
        if not self._items:
            return None
        key = self.policy.key
        return min(self._items, key=lambda r: (key(r, now), r.arrival_seq))


class GroupedQueue(WaitingQueue):
    """A dynamic key over groups kept in a fixed order (:meth:`Policy.group_of`):
    a read ranks only the groups' heads, so it costs the number of groups."""

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy)
        # group -> its requests sorted as (order_in_group, seq, request)
        self._groups: dict[Hashable, list] = {}
        # request_id -> (group, order, seq) while it waits
        self._place: dict[str, tuple] = {}
        # (time, n, place, request) for regroup_at, stale once the request's place is another
        self._timers: list = []
        self._timer_seq = count()

    def __len__(self) -> int:
        return len(self._place)

    def add(self, request: Request, now: float) -> None:
        policy = self.policy
        group, order = policy.group_of(request, now), policy.order_in_group(request)
        insort(self._groups.setdefault(group, []), (order, request.arrival_seq, request))
        place = self._place[request.request_id] = (group, order, request.arrival_seq)
        t = policy.regroup_at(request)
        if t is not None and t >= now:  # one already past is in group_of's answer
            heapq.heappush(self._timers, (t, next(self._timer_seq), place, request))

    def _regroup(self, now: float) -> None:
        """Move the requests whose regroup time has passed to their groups now."""
        timers = self._timers
        while timers and timers[0][0] < now:
            _, _, place, request = heapq.heappop(timers)
            if self._place.get(request.request_id) is place:
                self._unlink(request.request_id)
                self.add(request, now)

    def candidates(self, now: float) -> Iterator[tuple[object, Request]]:
        """The groups merged by ``key`` of their heads; positions are (group, index)."""
        self._regroup(now)
        key = self.policy.key
        heads = []
        for group, entries in self._groups.items():
            req = entries[0][2]
            heads.append((key(req, now), req.arrival_seq, 0, group))
        heapq.heapify(heads)
        while heads:
            _, _, i, group = heads[0]
            entries = self._groups[group]
            yield (group, i), entries[i][2]
            if i + 1 < len(entries):
                req = entries[i + 1][2]
                heapq.heapreplace(heads, (key(req, now), req.arrival_seq, i + 1, group))
            else:
                heapq.heappop(heads)

    def peek(self, now: float) -> Request | None:
        if not self:
            return None
        return next(self.candidates(now))[1]  # ranks only the groups' heads

    def remove_positions(self, positions: Iterable[object]) -> None:
        for group, i in sorted(positions, key=lambda p: p[1], reverse=True):
            self._unlink(self._groups[group][i][2].request_id)

    def remove(self, request: Request) -> None:
        if request.request_id not in self._place:
            raise KeyError(request.request_id)
        self._unlink(request.request_id)

    def _unlink(self, request_id: str) -> None:
        group, order, seq = self._place.pop(request_id)
        entries = self._groups[group]
        del entries[bisect_left(entries, (order, seq))]  # (order, seq) < (order, seq, request)
        if not entries:
            del self._groups[group]


def groups_its_queue(policy: Policy) -> bool:
    """Whether ``policy`` groups its waiting requests (a dynamic key and its own
    :meth:`Policy.group_of`)."""
    return policy.dynamic_key and overrides(policy, "group_of")


def create_waiting_queue(policy: Policy) -> WaitingQueue:
    """The waiting queue for ``policy``'s kind of key."""
    if not policy.dynamic_key:
        return SortedQueue(policy)
    return GroupedQueue(policy) if groups_its_queue(policy) else ResortedQueue(policy)
