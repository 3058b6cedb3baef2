"""The waiting queue, kept in the policy's order."""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections.abc import Hashable, Iterable, Iterator
from itertools import count

from testbed.core.policy import Policy
from testbed.core.request import Request


class WaitingQueue:
    """Requests waiting for admission, served in ``policy.key`` order.

    With a static key (``policy.dynamic_key`` false) the queue stays sorted as
    requests enter, so reading it costs nothing; with a dynamic key it is
    sorted when read, unless the policy groups its requests
    (:meth:`Policy.group_of`): then each group stays sorted by
    ``policy.order_in_group``, a read merges the groups ranking only their
    heads by ``key``, and a request moves group at ``policy.regroup_at``.
    Ties go to the earlier arrival (``arrival_seq``).
    """

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.dynamic = policy.dynamic_key
        self.grouped = self.dynamic and type(policy).group_of is not Policy.group_of
        # static: sorted (key, seq, request); dynamic: requests; grouped: unused
        self._items: list = []
        # grouped: group -> its requests sorted as (order_in_group, seq, request);
        # request_id -> (group, order, seq) while it waits; (time, n, place, request)
        # for regroup_at, stale once the request's place is another.
        self._groups: dict[Hashable, list] = {}
        self._place: dict[str, tuple] = {}
        self._timers: list = []
        self._timer_seq = count()

    def __len__(self) -> int:
        return len(self._place) if self.grouped else len(self._items)

    def __bool__(self) -> bool:
        return len(self) > 0

    def add(self, request: Request, now: float) -> None:
        if self.grouped:
            self._add_grouped(request, now)
        elif self.dynamic:
            self._items.append(request)
        else:
            insort(self._items, (self.policy.key(request, now), request.arrival_seq, request))

    def _add_grouped(self, request: Request, now: float) -> None:
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
                self._add_grouped(request, now)

    def candidates(self, now: float) -> Iterator[tuple[object, Request]]:
        """Yield ``(position, request)``, most urgent first, lazily.

        The queue must not change while this runs; remove what was taken
        afterwards with :meth:`remove_positions`.
        """
        if self.grouped:
            self._regroup(now)
            yield from self._merge_groups(now)
            return
        items = self._items
        if self.dynamic:
            key = self.policy.key
            items.sort(key=lambda r: (key(r, now), r.arrival_seq))
            yield from enumerate(items)
        else:
            for pos in range(len(items)):
                yield pos, items[pos][2]

    def _merge_groups(self, now: float) -> Iterator[tuple[object, Request]]:
        """The groups merged by ``key`` of their heads; positions are (group, index)."""
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
        if self.grouped:
            return next(self.candidates(now))[1]  # ranks only the groups' heads
        if self.dynamic:
            key = self.policy.key
            return min(self._items, key=lambda r: (key(r, now), r.arrival_seq))
        return self._items[0][2]

    def remove_positions(self, positions: Iterable[object]) -> None:
        """Remove the requests at these positions (as yielded by :meth:`candidates`)."""
        if not self.grouped:
            for pos in sorted(positions, reverse=True):
                del self._items[pos]
            return
        for group, i in sorted(positions, key=lambda p: p[1], reverse=True):
            self._unlink(self._groups[group][i][2].request_id)

    def remove(self, request: Request) -> None:
        if self.grouped:
            if request.request_id not in self._place:
                raise KeyError(request.request_id)
            self._unlink(request.request_id)
            return
        for pos, item in enumerate(self._items):
            if (item if self.dynamic else item[2]) is request:
                del self._items[pos]
                return
        raise KeyError(request.request_id)

    def _unlink(self, request_id: str) -> None:
        group, order, seq = self._place.pop(request_id)
        entries = self._groups[group]
        del entries[bisect_left(entries, (order, seq))]  # (order, seq) < (order, seq, request)
        if not entries:
            del self._groups[group]
