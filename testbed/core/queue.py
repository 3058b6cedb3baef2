"""The waiting queue, kept in the policy's order."""

from __future__ import annotations

from bisect import insort
from collections.abc import Iterable, Iterator

from testbed.core.policy import Policy
from testbed.core.request import Request


class WaitingQueue:
    """Requests waiting for admission, served in ``policy.key`` order.

    With a static key (``policy.dynamic_key`` false) the queue stays sorted as
    requests enter, so reading it costs nothing; with a dynamic key it is
    sorted when read. Ties go to the earlier arrival (``arrival_seq``).
    """

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.dynamic = policy.dynamic_key
        self._items: list = []  # static: sorted (key, seq, request); dynamic: requests

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def add(self, request: Request, now: float) -> None:
        if self.dynamic:
            self._items.append(request)
        else:
            insort(self._items, (self.policy.key(request, now), request.arrival_seq, request))

    def candidates(self, now: float) -> Iterator[tuple[int, Request]]:
        """Yield ``(position, request)``, most urgent first, lazily.

        The queue must not change while this runs; remove what was taken
        afterwards with :meth:`remove_positions`.
        """
        items = self._items
        if self.dynamic:
            key = self.policy.key
            items.sort(key=lambda r: (key(r, now), r.arrival_seq))
            yield from enumerate(items)
        else:
            for pos in range(len(items)):
                yield pos, items[pos][2]

    def peek(self, now: float) -> Request | None:
        if not self._items:
            return None
        if self.dynamic:
            key = self.policy.key
            return min(self._items, key=lambda r: (key(r, now), r.arrival_seq))
        return self._items[0][2]

    def remove_positions(self, positions: Iterable[int]) -> None:
        """Remove the requests at these positions (as yielded by :meth:`candidates`)."""
        for pos in sorted(positions, reverse=True):
            del self._items[pos]

    def remove(self, request: Request) -> None:
        for pos, item in enumerate(self._items):
            if (item if self.dynamic else item[2]) is request:
                del self._items[pos]
                return
        raise KeyError(request.request_id)

    def __iter__(self):
        return iter(self._items if self.dynamic else [item[2] for item in self._items])
