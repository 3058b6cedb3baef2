"""vLLM's waiting ``RequestQueue`` over the testbed's own waiting queue.

vLLM's waiting loop peeks the head, then pops it whether it admits or skips
it, and after the loop prepends the skipped ones back. Here the first peek of a
step opens the testbed queue's ``candidates(now)`` (the same ranking, at the
same point of the step, as in the testbed), each pop moves on to the next
candidate and marks it taken, a prepend of a request popped this step un-takes
it (it never left its place), and :meth:`PolicyQueue.close` removes what was
taken, as the testbed's ``remove_positions`` does. :meth:`PolicyQueue.head`
reads the head before the step (a preemptive policy's displacement), and
:meth:`PolicyQueue.hold` makes the queue look empty to the step's waiting loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import suppress

from vllm.v1.core.sched.request_queue import RequestQueue
from vllm.v1.request import Request

from testbed.core.policy import Policy
from testbed.core.queue import create_waiting_queue
from testbed.vllm_backend.views import RequestView


class PolicyQueue(RequestQueue):
    """Waiting requests in ``policy``'s order (the testbed's queue of views)."""

    def __init__(
        self, policy: Policy, view_of: Callable[[Request], RequestView], now: Callable[[], float]
    ) -> None:
        self.q = create_waiting_queue(policy)
        self.view_of = view_of
        self.now = now
        self._open: Iterator | None = None  # this step's candidates, once peeked
        self._head: tuple[object, RequestView] | None = None
        self._taken: dict[str, object] = {}  # request_id -> position, popped this step
        self._later: list[RequestView] = []  # added while the candidates are open
        self._held = False  # empty to the waiting loop until the step's close

    # --- a step's pass over the candidates ---
    def _advance(self) -> None:
        self._head = next(self._open, None)

    def _head_view(self) -> RequestView:
        if self._open is None:
            self._open = self.q.candidates(self.now())
            self._advance()
        if self._head is None:
            raise IndexError("peek from an empty waiting queue")
        return self._head[1]

    def peek_request(self) -> Request:
        return self._head_view().req

    def pop_request(self) -> Request:
        view = self._head_view()
        self._taken[view.request_id] = self._head[0]
        self._advance()
        return view.req

    def head(self) -> RequestView | None:
        """The most urgent waiting request now, read outside a pass (the testbed
        queue's ``peek``, as the testbed's scheduler reads it before its step)."""
        if self._open is not None:
            raise RuntimeError("the waiting queue's head read during its pass")
        return self.q.peek(self.now())

    def hold(self) -> None:
        """Admit no one this step: the queue is false (vLLM's waiting loop stops at
        once) until :meth:`close`; its length still counts its requests."""
        self._held = True

    def close(self) -> None:
        """End the step's pass: remove the requests taken from the queue."""
        self._held = False
        if self._open is not None:
            self._open.close()
            self._open = self._head = None
            if self._taken:
                self.q.remove_positions(list(self._taken.values()))
                self._taken.clear()
        later, self._later = self._later, []
        for view in later:
            self.q.add(view, self.now())

    # --- entering and leaving ---
    def add_request(self, request: Request) -> None:
        view = self.view_of(request)
        if self._open is not None:
            self._later.append(view)
        else:
            self.q.add(view, self.now())

    def prepend_request(self, request: Request) -> None:
        if self._taken.pop(request.request_id, None) is None:
            self.add_request(request)  # back after a preemption: to its rank

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.prepend_request(request)

    def remove_request(self, request: Request) -> None:
        self.remove_requests((request,))

    def remove_requests(self, requests: Iterable[Request]) -> None:
        if self._open is not None:
            raise RuntimeError("requests removed from the waiting queue during its pass")
        for request in requests:  # as vLLM's queues: one not here is ignored
            view = self.view_of(request)
            if view in self._later:
                self._later.remove(view)
            else:
                with suppress(KeyError):
                    self.q.remove(view)

    def __len__(self) -> int:
        return len(self.q) - len(self._taken) + len(self._later)

    def __bool__(self) -> bool:
        return not self._held and len(self) > 0

    def __iter__(self) -> Iterator[Request]:
        if self._open is not None:
            raise RuntimeError("the waiting queue iterated during its pass")
        return iter([view.req for _, view in self.q.candidates(self.now())])
