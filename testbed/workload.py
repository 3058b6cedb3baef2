"""Turn a trace (a DataFrame, see ``traces``) into :class:`Request` objects.

In simulation a request needs only lengths (and prefix hash ids, so that the
prefix cache sees which requests share blocks). The real engine needs token
ids: they are drawn from a seeded generator, and a prompt's prefix blocks are
derived from their hash ids alone, so that requests sharing a hash share the
same tokens (and the prefix cache hits exactly where the trace says).

A closed-loop trace (:mod:`traces.closed_loop`) has no arrival times:
:class:`ClosedLoop` sends its requests as its clients free, in both modes.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Iterable, Iterator

import numpy as np
import pandas as pd

from testbed.core import Request, SamplingParams

_PIECE = 65_536


def _opt(value) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


def to_requests(
    trace: pd.DataFrame,
    with_tokens: bool = False,
    vocab_size: int = 32000,
    seed: int = 0,
    eos_token_id: int | None = None,
) -> list[Request]:
    """One :class:`Request` per trace row; it stops at the row's output length."""
    options = (with_tokens, vocab_size, seed, eos_token_id)
    return [req for _, req in _requests(trace, np.arange(len(trace)), *options)]


class ClosedLoop:
    """``max_concurrency`` clients sending requests in a closed loop: each sends its
    next request when its last one has ended (served, rejected or aborted), and
    the i-th request sent is the i-th of ``requests`` (``(row, request)`` pairs in
    trace order). Sending stamps a request's ``arrival_time``: its client's free
    time. The first ``max_concurrency`` are sent at 0.

    The transport reports each ended request (:meth:`ended`) and sends what is due
    (:meth:`send`). Clients free at the same time send in client order, so the
    rows they get do not depend on the order their ends were reported in."""

    def __init__(self, requests: Iterable[tuple[int, Request]], max_concurrency: int) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.max_concurrency = max_concurrency
        self._source = iter(requests)
        self._next = next(self._source, None)
        self._free = [(0.0, client) for client in range(max_concurrency)]  # a heap
        self._client: dict[str, int] = {}  # request id -> its client, while it is out

    @property
    def done(self) -> bool:
        """Every request has been sent."""
        return self._next is None

    @property
    def next_time(self) -> float:
        """When the next request is sent (inf: every client waits, or none is left)."""
        return self._free[0][0] if self._free and self._next is not None else math.inf

    def send(self, now: float) -> Iterator[tuple[int, Request]]:
        """The requests due by ``now``, each stamped with its send time; one freed
        while they are taken (a rejection) is sent too, if due."""
        free = self._free
        while self._next is not None and free and free[0][0] <= now:
            at, client = heapq.heappop(free)
            row, req = self._next
            self._next = next(self._source, None)
            req.arrival_time = at
            self._client[req.request_id] = client
            yield row, req

    def ended(self, request: Request, now: float) -> None:
        """``request`` has ended, reported at ``now``: its client is free at its
        finish (a simulator may report a finish ahead of its time), or at ``now``
        where that is later (an end seen only after it happened)."""
        client = self._client.pop(request.request_id, None)
        if client is not None:
            finish = request.finish_time
            heapq.heappush(self._free, (now if finish is None else max(finish, now), client))

    def unsent(self) -> Iterator[tuple[int, Request]]:
        """Every request not sent (consumes them), its arrival time NaN: it never arrived."""
        while self._next is not None:
            row, req = self._next
            self._next = next(self._source, None)
            req.arrival_time = math.nan
            yield row, req


class RequestStream:
    """The trace's requests (without token ids), made one at a time in arrival
    order as a simulation reaches them: a million requests are not all held at
    once. Iterating gives ``(row, request)``; ``row`` is the request's position in
    the trace (the order of ``requests.csv``). Requests of equal arrival time come
    in trace order, as a stable sort of :func:`to_requests`' list would give them."""

    def __init__(self, trace: pd.DataFrame) -> None:
        self.trace = trace

    def __len__(self) -> int:
        return len(self.trace)

    def __iter__(self) -> Iterator[tuple[int, Request]]:
        order = np.argsort(self.trace["arrival_s"].to_numpy(), kind="stable")
        return _requests(self.trace, order, False, 0, 0, None)

    def in_rows(self) -> Iterator[tuple[int, Request]]:
        """``(row, request)`` in trace order (a closed loop's order of sending)."""
        return _requests(self.trace, np.arange(len(self.trace)), False, 0, 0, None)


_COLUMNS = (
    "arrival_s",
    "prompt_tokens",
    "output_tokens",
    "tenant",
    "priority",
    "ttft_slo_s",
    "tpot_slo_s",
    "prefix_hash_ids",
)


def _requests(
    trace: pd.DataFrame,
    rows: np.ndarray,
    with_tokens: bool,
    vocab_size: int,
    seed: int,
    eos_token_id: int | None,
) -> Iterator[tuple[int, Request]]:
    """The requests of trace rows ``rows``, in that order, with their row numbers."""
    block = int(trace.attrs.get("hash_block_tokens", 512))
    # Requests with the same output length share their (never mutated) sampling
    # parameters, and equal SLOs one float: a million requests repeat a few values.
    params: dict[int, SamplingParams] = {}
    shared: dict[object, object] = {}
    for first in range(0, len(rows), _PIECE):  # Python objects of a piece of rows at a time
        piece = rows[first : first + _PIECE]
        cols = [trace[c].iloc[piece].tolist() for c in _COLUMNS]
        for i, t, n_in, n_out, tenant, prio, ttft, tpot, hashes in zip(
            piece.tolist(), *cols, strict=True
        ):
            hashes = tuple(hashes) if hashes is not None and not _is_nan(hashes) else None
            tokens = (
                prompt_tokens(i, int(n_in), hashes, block, vocab_size, seed)
                if with_tokens
                else None
            )
            n_out = int(n_out)
            if n_out not in params:
                params[n_out] = SamplingParams(max_tokens=n_out, ignore_eos=True)
            ttft, tpot, tenant = (
                shared.setdefault(v, v) for v in (_opt(ttft), _opt(tpot), str(tenant))
            )
            yield (
                i,
                Request(
                    request_id=f"req-{i}",
                    prompt_token_ids=tokens,
                    num_prompt_tokens=int(n_in),
                    sampling_params=params[n_out],
                    target_output_tokens=n_out,
                    eos_token_id=eos_token_id,
                    tenant=tenant,
                    priority=int(prio),
                    ttft_slo_s=ttft,
                    tpot_slo_s=tpot,
                    arrival_time=float(t),
                    prefix_hash_ids=hashes,
                    hash_block_tokens=block,
                ),
            )


def _is_nan(x) -> bool:
    return isinstance(x, float) and math.isnan(x)


def prompt_tokens(
    index: int, length: int, hashes: tuple[int, ...] | None, block: int, vocab: int, seed: int
) -> list[int]:
    """Seeded token ids; the span of each prefix hash id depends on that id only."""
    tokens: list[int] = []
    for h in hashes or ():
        if len(tokens) >= length:
            break
        rng = random.Random(f"hash-{seed}-{h}")
        tokens.extend(rng.randrange(vocab) for _ in range(min(block, length - len(tokens))))
    rng = random.Random(f"req-{seed}-{index}")
    tokens.extend(rng.randrange(vocab) for _ in range(length - len(tokens)))
    return tokens
