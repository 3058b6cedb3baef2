"""The cluster's control plane, shared by the simulator and the real cluster:
what :class:`~testbed.core.engine.EngineCore` is for one engine, for replicas.

:class:`ClusterCore` owns every decision made above the engines: the router's
choice of replica, the disaggregation decider, the pairing of a disaggregated
request with a decode replica, the prefill leg and its hand-over, and what the
requests of a lost replica become. It takes events (an arrival, requests back
from a replica, a replica lost, a KV transfer failed) and returns actions
(:class:`Deliver`, :class:`Finish`, :class:`Release`, :class:`PeerLost`) that a
transport carries out: simpy processes in the simulator
(:mod:`testbed.sim.simulator`), worker processes in the real cluster
(:mod:`testbed.engine.cluster`). Time is the caller's (``now``), and what the
core reads of a replica beyond its own counts comes from a
:class:`ReplicaProbe` the transport provides: its KV usage and prefix cache.

It also owns the simulator's fast-path rule (:meth:`ClusterCore.next_event_time`):
the earliest time a decision may read or change a replica, which its jumps must
not pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from testbed.core.kv_connector import hand_over, prefill_leg
from testbed.core.request import Request, RequestStatus
from testbed.core.routing import Decider, Router


class ReplicaProbe(Protocol):
    """What the transport reports of a replica: its KV usage and prefix cache."""

    @property
    def kv_usage(self) -> float: ...

    def prefix_hit_tokens(self, request: Request) -> int: ...


@dataclass(slots=True)
class Deliver:
    """Send ``request`` to ``replica`` (a whole request, a prefill leg, or a
    disaggregated request whose KV the replica loads)."""

    replica: int
    request: Request


@dataclass(slots=True)
class Finish:
    """``request`` has ended for its user (served, rejected or aborted)."""

    request: Request


@dataclass(slots=True)
class Release:
    """``replica`` frees the blocks it keeps for leg ``leg_id`` (its KV is not wanted)."""

    replica: int
    leg_id: str


@dataclass(slots=True)
class PeerLost:
    """``replica`` gives up on KV loads from ``lost``, which is gone."""

    replica: int
    lost: int


Action = Deliver | Finish | Release | PeerLost


class ReplicaSlot:
    """A replica as the core keeps it and as routers see it (a
    :class:`~testbed.core.routing.ReplicaView`): ``index`` is its place in its
    pool of live replicas, ``replica`` its number in the cluster."""

    __slots__ = (
        "alive",
        "index",
        "num_outstanding",
        "num_outstanding_tokens",
        "outstanding",
        "probe",
        "replica",
    )

    def __init__(self, replica: int, probe: ReplicaProbe) -> None:
        self.replica = self.index = replica
        self.probe = probe
        self.outstanding: dict[str, Request] = {}  # sent there, not back yet
        self.num_outstanding = self.num_outstanding_tokens = 0
        self.alive = True

    @property
    def kv_usage(self) -> float:
        return self.probe.kv_usage

    def prefix_hit_tokens(self, request: Request) -> int:
        return self.probe.prefix_hit_tokens(request)


def caches_read(
    num_replicas: int,
    router: Router,
    num_prefill: int = 0,
    decider: Decider | None = None,
    pairing: Router | None = None,
) -> list[bool]:
    """Per replica, whether a decision reads its prefix cache: the router's of its
    pool (prefill replicas, or every replica without disaggregation), and for a
    decode replica the pairing's or the decider's. Such a replica must be stepped
    in the simulator and report its cache in the real cluster."""
    if not num_prefill:
        return [router.reads_cache] * num_replicas
    decode = (decider is not None and decider.reads_cache) or (
        pairing is not None and pairing.reads_cache
    )
    return [router.reads_cache if i < num_prefill else decode for i in range(num_replicas)]


class ClusterCore:
    """Routing, disaggregation and recovery for ``len(probes)`` replicas.

    Without ``num_prefill`` every replica serves whole requests, the ``router``
    choosing. With it, replicas ``0..num_prefill-1`` are prefill instances (the
    router picks one for each prefill leg) and the rest decode instances (the
    ``pairing`` router picks one for each request); the ``decider`` (None:
    always) says which requests are disaggregated. ``record``: keep every
    decision in :attr:`decisions` (``(kind, request id, value)``) for tests that
    compare modes."""

    def __init__(
        self,
        probes: Sequence[ReplicaProbe],
        router: Router,
        num_prefill: int = 0,
        decider: Decider | None = None,
        pairing: Router | None = None,
        record: bool = False,
    ) -> None:
        n = len(probes)
        if num_prefill and not 0 < num_prefill < n:
            raise ValueError(
                f"need a prefill and a decode replica, got {num_prefill}P{n - num_prefill}D"
            )
        if num_prefill and pairing is None:
            raise ValueError("a disaggregated cluster needs a pairing router")
        self.slots = [ReplicaSlot(i, p) for i, p in enumerate(probes)]
        self.router, self.num_prefill = router, num_prefill
        self.disaggregated = num_prefill > 0
        self.decider, self.pairing = decider, pairing
        self.legs: dict[str, Request] = {}  # prefill leg id -> its request
        self.paired: dict[str, int] = {}  # request id -> decode replica chosen at arrival
        self.num_disaggregated = 0
        self.decisions: list[tuple[str, str, object]] | None = [] if record else None
        self.prefill_pool: list[ReplicaSlot] = []
        self.decode_pool: list[ReplicaSlot] = []  # every replica, without disaggregation
        self._rebuild_pools()
        reads = caches_read(n, router, num_prefill, decider, pairing)
        # Whether a delivery may cut the replica's jumps (see next_event_time): a
        # decode replica or a colocated one (prefill replicas never jump) whose
        # cache no decision reads.
        self._cuttable = [
            n > 1 and not reads[i] and (not num_prefill or i >= num_prefill) for i in range(n)
        ]

    def _rebuild_pools(self) -> None:
        live = [s for s in self.slots if s.alive]
        self.prefill_pool = [s for s in live if s.replica < self.num_prefill]
        self.decode_pool = [s for s in live if s.replica >= self.num_prefill]
        for pool in (self.prefill_pool, self.decode_pool):
            for k, slot in enumerate(pool):
                slot.index = k

    # --- reading ---
    @property
    def idle(self) -> bool:
        """No prefill leg is out: nothing will be delivered but arrivals."""
        return not self.legs

    def num_outstanding(self) -> list[int]:
        """Per replica, the requests sent there and not back."""
        return [s.num_outstanding for s in self.slots]

    def alive(self, replica: int) -> bool:
        return self.slots[replica].alive

    def cut_by_delivery(self, replica: int) -> bool:
        """Whether decisions read ``replica`` only through counts and KV usage, so
        that its jumps may run past arrivals (a delivery to it cuts them)."""
        return self._cuttable[replica]

    def next_event_time(
        self,
        replica: int,
        next_arrival: float,
        next_transfer: Callable[[int], float] | None = None,
        step_end: Callable[[int], tuple[float, bool]] | None = None,
        min_step_s: float = 0.0,
    ) -> float:
        """The earliest time a decision may read or change ``replica`` (for one cut
        by deliveries: change it otherwise), given the next arrival, when the next
        transfer into a replica ends or fails (``next_transfer``), and for a
        prefill replica when its step under way ends and whether it finishes
        legs (``step_end``; ``min_step_s``: no step is shorter)."""
        transfer = next_transfer(replica) if next_transfer is not None else math.inf
        if self._cuttable[replica]:
            return transfer  # only a transfer into it changes it from outside
        t = next_arrival
        if self.legs and step_end is not None:
            # A prefill step hands its finished legs over as it ends; one that
            # finishes none may finish some in its next, no sooner than the
            # shortest step after it. (An idle one starts only on an event.)
            for slot in self.prefill_pool:
                end, finishing = step_end(slot.replica)
                t = min(t, end if finishing else end + min_step_s)
        return min(t, transfer)

    # --- events ---
    def arrive(self, request: Request, now: float) -> list[Action]:
        """A request arrives: where it goes."""
        if self.num_prefill:
            return self._dispatch(request, now)
        pool = self.decode_pool
        slot = pool[self.router.route(request, pool, now)]
        if self.decisions is not None:
            self.decisions.append(("route", request.request_id, slot.replica))
        return [self._send(slot, request)]

    def finish(self, replica: int, requests: Sequence[Request], now: float) -> list[Action]:
        """``requests`` came back from ``replica`` (finished there, or refused):
        who has ended, and where a finished leg's request goes on. A request the
        core does not know as outstanding there is ignored (a repeated report)."""
        slot = self.slots[replica]
        back = []
        for req in requests:
            if slot.outstanding.pop(req.request_id, None) is not None:
                slot.num_outstanding -= 1
                slot.num_outstanding_tokens -= req.num_prompt_tokens
                back.append(req)
        if not self.legs:
            return [Finish(req) for req in back]
        actions: list[Action] = []
        for req in back:
            original = self.legs.pop(req.request_id, None)
            if original is None:
                actions.append(Finish(req))
            elif hand_over(req, original):
                actions.append(self._send_decode(original, now))
            else:  # the leg was refused or aborted: so is the request
                self.paired.pop(original.request_id, None)
                actions.append(Finish(original))
        return actions

    def transfer_failed(self, src: int, leg_id: str) -> list[Action]:
        """A decode replica gave up loading leg ``leg_id``'s KV from ``src`` (it
        computes the prompt itself): ``src`` frees the blocks it kept."""
        return [Release(src, leg_id)] if self.slots[src].alive else []

    def lose(self, replica: int, now: float, reason: str) -> list[Action]:
        """``replica`` is gone: its outstanding requests start again elsewhere, from
        scratch (a leg's request from its start; a disaggregated request whole, its
        prefill replica told to free the KV), or, with no replica left, end
        aborted with ``reason``."""
        slot = self.slots[replica]
        slot.alive = False
        self._rebuild_pools()
        lost = list(slot.outstanding.values())
        slot.outstanding.clear()
        slot.num_outstanding = slot.num_outstanding_tokens = 0
        actions: list[Action] = []
        if replica < self.num_prefill:
            actions += [PeerLost(s.replica, replica) for s in self.decode_pool]
        live = self.prefill_pool or self.decode_pool
        for req in lost:
            if not live:
                req.status = RequestStatus.FINISHED_ABORTED
                req.finish_reason = req.reject_reason = reason
                req.finish_time = now
                self.legs.pop(req.request_id, None)
                actions.append(Finish(req))
                continue
            self._record("lost", req.request_id, replica)
            original = self.legs.pop(req.request_id, None)
            if original is not None:
                actions += self._dispatch(original, now)
            elif not self.num_prefill:
                slot = self._choose(req, self.decode_pool, self.router, now)
                actions.append(self._send(slot, req))
            else:
                params, req.kv_transfer_params = req.kv_transfer_params, None
                src = params.get("remote_instance") if params else None
                if src is not None and self.slots[src].alive:
                    actions.append(Release(src, params["remote_request_id"]))
                actions.append(self._send_decode(req, now))
        return actions

    # --- decisions ---
    def _record(self, kind: str, request_id: str, value) -> None:
        if self.decisions is not None:
            self.decisions.append((kind, request_id, value))

    def _choose(self, request: Request, pool: list[ReplicaSlot], router: Router, now: float):
        slot = pool[router.route(request, pool, now)]
        if self.decisions is not None:
            kind = "route" if router is self.router else "pair"
            self.decisions.append((kind, request.request_id, slot.replica))
        return slot

    def _send(self, slot: ReplicaSlot, request: Request) -> Deliver:
        slot.outstanding[request.request_id] = request
        slot.num_outstanding += 1
        slot.num_outstanding_tokens += request.num_prompt_tokens
        return Deliver(slot.replica, request)

    def _any_live(self) -> ReplicaSlot:
        return next(s for s in self.slots if s.alive)

    def _send_decode(self, request: Request, now: float) -> Deliver:
        """To its decode replica: the one paired at arrival if still there, else
        the pairing's choice now; with none left, to any replica, whole."""
        paired = self.paired.pop(request.request_id, None)
        if paired is not None and self.slots[paired].alive:
            return self._send(self.slots[paired], request)
        if self.decode_pool:
            return self._send(self._choose(request, self.decode_pool, self.pairing, now), request)
        request.kv_transfer_params = None  # computed again whole
        return self._send(self._any_live(), request)

    def _dispatch(self, request: Request, now: float) -> list[Action]:
        """A disaggregated cluster's arrival: the decider's choice, then a prefill
        leg to the prefill replica the router picks, or the request whole to the
        decode replica the pairing picks. The pairing is asked once per request:
        here if the decider must know what the decode replica holds (that replica
        then takes the request after its prefill) or the request stays whole,
        else when its leg is back."""
        if not self.prefill_pool or not self.decode_pool:
            if self.decode_pool:
                return [self._send_decode(request, now)]
            return [self._send(self._any_live(), request)]
        uncached, decode = request.num_prompt_tokens, None
        decider = self.decider
        if decider is not None and decider.reads_cache:
            decode = self._choose(request, self.decode_pool, self.pairing, now)
            uncached -= decode.prefix_hit_tokens(request)
        split = decider is None or decider.disaggregate(request, uncached)
        self._record("decide", request.request_id, (split, uncached))
        if not split:
            slot = decode or self._choose(request, self.decode_pool, self.pairing, now)
            return [self._send(slot, request)]
        leg = prefill_leg(request)
        self.legs[leg.request_id] = request
        if decode is not None:
            self.paired[request.request_id] = decode.replica
        self.num_disaggregated += 1
        return [self._send(self._choose(leg, self.prefill_pool, self.router, now), leg)]
