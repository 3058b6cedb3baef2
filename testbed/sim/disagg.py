"""Disaggregated prefill/decode in the simulator: P prefill and D decode
replicas, the KV of each prompt moved between them over a modelled link.

An arrival that the decider disaggregates goes, as a one-token "prefill leg"
(``kv_transfer_params={"do_remote_decode": True}``, as vLLM's proxy sends it), to
the prefill replica the router picks; when the leg finishes there its blocks
stay allocated (the producer's connector) and the request itself goes to the
decode replica the pairing router picks (``cluster.pairing``, by default the
least KV usage; asked at arrival instead when the decider looks up what that
replica has cached), whose connector loads the prompt's KV (all but the last
token, which it computes to sample the first output token); the load moves over
the link between the two replicas (:mod:`testbed.sim.kv_transfer`), and as it
ends the decode side runs the request and the prefill side frees the leg's
blocks. TTFT includes the prefill, the transfer and the decode side's first
step. An arrival the decider keeps whole goes to the decode replica the pairing
picks and is served there.

The fast path: prefill replicas never jump (a leg ends with its prefill). A
decode replica's jumps are cut by a request delivered to it and bounded only by
a transfer into it ending or failing (the pairing reads its KV usage from the
planned steps: ``Replica.kv_usage``); with a decider that reads its prefix
cache, they stop before every event that may touch it instead: an arrival, a
prefill step that may end with finished legs, a transfer. Processor sharing only
delays a transfer already under way, so a link's next finish is a safe bound.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from policies.deciders import Always, Decider
from policies.routers import LeastKVUsage, PoolView, Router
from testbed.core import EngineCore, Request
from testbed.core.kv_connector import hand_over, prefill_leg
from testbed.core.kv_faults import KVFaults
from testbed.sim.kv_transfer import KVTransfers
from testbed.sim.link import LinkSpec
from testbed.sim.simulator import Replica, Simulation


class DisaggSimulation(Simulation):
    """Replicas ``0..P-1`` prefill (their engines' connectors producers), ``P..P+D-1``
    decode (consumers); ``make_engine(i, clock)`` builds each."""

    def __init__(
        self,
        requests,
        make_engine: Callable[[int, Callable[[], float]], EngineCore],
        latency_model,
        num_prefill: int,
        num_decode: int,
        link: LinkSpec,
        kv_bytes_per_token: float,
        router=None,
        decider: Decider | None = None,
        pairing: Router | None = None,
        faults: KVFaults | None = None,
        timeout_s: float = float("inf"),
        **kwargs,
    ) -> None:
        if num_prefill < 1 or num_decode < 1:
            raise ValueError(
                f"need a prefill and a decode replica, got {num_prefill}P{num_decode}D"
            )
        super().__init__(
            requests, make_engine, latency_model, num_prefill + num_decode, router, **kwargs
        )
        self.num_prefill = num_prefill
        self.prefill_pool = [PoolView(r, k) for k, r in enumerate(self.replicas[:num_prefill])]
        self.decode_pool = [PoolView(r, k) for k, r in enumerate(self.replicas[num_prefill:])]
        self.decider = decider or Always()
        self.pairing = pairing or LeastKVUsage()
        self.transfers = KVTransfers(
            self.env,
            self.replicas,
            link,
            kv_bytes_per_token,
            lambda i, rid: self.replicas[i].engine.scheduler.requests[rid],
            faults,
            timeout_s,
        )
        for i, rep in enumerate(self.replicas):
            rep.engine.executor.kv_transfers = lambda meta, i=i: self.transfers.start(i, meta)
        self.legs: dict[str, Request] = {}  # prefill leg id -> its request
        self.paired: dict[str, Replica] = {}  # request id -> its decode replica, if chosen
        # No step is shorter (latency models are monotone in every feature).
        self.min_step_s = latency_model.predict(1, 1, 1.0, 1, 1)
        speed = getattr(self.replicas[0].engine.executor, "speed", None)
        if speed is not None:
            self.min_step_s *= speed.min_factor
        self.num_disaggregated = 0
        # A decode replica's jumps need not stop for the arrivals and handovers that
        # only read its KV usage (read from its planned steps); one delivered to it
        # cuts its jump. The decider that reads its prefix cache needs it stepped.
        decider_reads_cache = self.decider.needs_cached_tokens
        for rep in self.replicas:
            rep.interruptible = rep.index >= num_prefill and not decider_reads_cache

    def _pair(self, request: Request, now: float) -> Replica:
        """The decode replica for a request (the pairing router's choice)."""
        return self.decode_pool[self.pairing.route(request, self.decode_pool, now)].replica

    def route(self, request: Request, now: float) -> None:
        # The pairing is asked once per request: here if the decider must know
        # what the decode replica holds (that replica then takes the request after
        # its prefill), or if the request stays whole; else when its leg is back.
        uncached, decode = request.num_prompt_tokens, None
        if self.decider.needs_cached_tokens:
            decode = self._pair(request, now)
            uncached -= decode.engine.scheduler.prefix_hit_tokens(request)
        if not self.decider.disaggregate(request, uncached):
            (decode or self._pair(request, now)).deliver(request)
            return
        leg = prefill_leg(request)
        self.legs[leg.request_id] = request
        if decode is not None:
            self.paired[request.request_id] = decode
        self.num_disaggregated += 1
        pool = self.prefill_pool
        pool[self.dispatcher.router.route(leg, pool, now)].replica.deliver(leg)

    def arrivals_done(self) -> bool:
        return self.dispatcher.done and not self.legs

    def next_event_time(self, replica: Replica) -> float:
        if replica.interruptible:  # only a transfer into it changes it from outside
            return self.transfers.next_event_time(replica.index)
        t = self.dispatcher.next_arrival_time
        if self.legs:
            # A prefill step hands its finished legs over as it ends; a replica
            # whose step finishes none may finish some in its next, no sooner than
            # the shortest step after it. (An idle one starts only on an event.)
            for view in self.prefill_pool:
                rep = view.replica
                end = rep.step_end if rep.finishing else rep.step_end + self.min_step_s
                t = min(t, end)
        return min(t, self.transfers.next_event_time(replica.index))

    def on_finished(self, finished) -> None:
        users = []
        for req in finished:
            original = self.legs.pop(req.request_id, None)
            if original is None:
                users.append(req)
            elif hand_over(req, original):
                decode = self.paired.pop(original.request_id, None)
                (decode or self._pair(original, self.env.now)).deliver(original)
            else:  # the leg was refused or aborted: so is the request
                self.paired.pop(original.request_id, None)
                users.append(original)
        if users:
            super().on_finished(users)
        if not self.legs and self.dispatcher.done:
            for rep in self.replicas:  # those waiting for more may stop
                rep.wake()

    def disagg_metrics(self, duration_s: float) -> dict[str, float]:
        """``metrics.json``'s fields of the cluster: transfers, links, each pool's
        busy fraction (its shape is the run's, in both modes: ``job.cluster_shape``)."""
        out = {
            "num_disaggregated": self.num_disaggregated,
            **self.transfers.metrics(duration_s),
        }
        replica = np.asarray(self.steps.column("replica"))
        latency = np.asarray(self.steps.column("latency_s"))
        for name, lo, hi in (
            ("prefill", 0, self.num_prefill),
            ("decode", self.num_prefill, len(self.replicas)),
        ):
            busy = latency[(replica >= lo) & (replica < hi)].sum()
            out[f"{name}_pool_utilization"] = (
                float(busy / (duration_s * (hi - lo))) if duration_s > 0 else 0.0
            )
        return out
