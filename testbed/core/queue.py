"""The waiting queue, kept in the policy's order."""

from __future__ import annotations

import heapq
from bisect import insort
from collections.abc import Hashable, Iterable, Iterator

from testbed.core.policy import Policy
from testbed.core.request import Request


class WaitingQueue:
    """Requests waiting for admission, served in ``policy.key`` order.

    With a static key (``policy.dynamic_key`` false) the queue stays sorted as
    requests enter, so reading it costs nothing; with a dynamic key it is
    sorted when read, unless the policy groups its requests
    (:meth:`Policy.group_of`): then each group stays sorted by
    ``policy.order_in_group`` and a read merges the groups, ranking only their
    heads by ``key``. Ties go to the earlier arrival (``arrival_seq``).
    """

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.dynamic = policy.dynamic_key
        self.grouped = self.dynamic and type(policy).group_of is not Policy.group_of
        # static: sorted (key, seq, request); dynamic: requests; grouped: unused
        self._items: list = []
        # grouped: group -> its requests sorted as (order_in_group, seq, request)
        self._groups: dict[Hashable, list] = {}
        self._group_of: dict[str, Hashable] = {}  # request_id -> its group, while waiting

    def __len__(self) -> int:
        return len(self._group_of) if self.grouped else len(self._items)

    def __bool__(self) -> bool:
        return len(self) > 0

    def add(self, request: Request, now: float) -> None:
        if self.grouped:
            group = self.policy.group_of(request)
            self._group_of[request.request_id] = group
            entry = (self.policy.order_in_group(request), request.arrival_seq, request)
            insort(self._groups.setdefault(group, []), entry)
        elif self.dynamic:
            self._items.append(request)
        else:
            insort(self._items, (self.policy.key(request, now), request.arrival_seq, request))

    def candidates(self, now: float) -> Iterator[tuple[object, Request]]:
        """Yield ``(position, request)``, most urgent first, lazily.

        The queue must not change while this runs; remove what was taken
        afterwards with :meth:`remove_positions`.
        """
        if self.grouped:
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
            key = self.policy.key
            heads = (entries[0][2] for entries in self._groups.values())
            return min(heads, key=lambda r: (key(r, now), r.arrival_seq))
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
            self._delete(group, i)

    def remove(self, request: Request) -> None:
        if self.grouped:
            group = self._group_of.get(request.request_id)
            for i, entry in enumerate(self._groups.get(group, ())):
                if entry[2] is request:
                    self._delete(group, i)
                    return
            raise KeyError(request.request_id)
        for pos, item in enumerate(self._items):
            if (item if self.dynamic else item[2]) is request:
                del self._items[pos]
                return
        raise KeyError(request.request_id)

    def _delete(self, group: Hashable, i: int) -> None:
        entries = self._groups[group]
        del self._group_of[entries[i][2].request_id]
        del entries[i]
        if not entries:
            del self._groups[group]

    def __iter__(self):
        if self.grouped:
            return (entry[2] for entries in self._groups.values() for entry in entries)
        return iter(self._items if self.dynamic else [item[2] for item in self._items])
