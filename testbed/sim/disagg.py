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

Every decision (decider, routers, pairing, hand-over) is the cluster core's
(:class:`~testbed.core.cluster.ClusterCore`), as in the real cluster; this
module adds the link and the fast path's inputs. Prefill replicas never jump (a
leg ends with its prefill). A decode replica's jumps are cut by a request
delivered to it and bounded only by a transfer into it ending or failing (the
pairing reads its KV usage from the planned steps: ``Replica.kv_usage``); with
a decider or pairing that reads its prefix cache, they stop before every event
that may touch it instead: an arrival, a prefill step that may end with
finished legs, a transfer (the core's rule). Processor sharing only delays a
transfer already under way, so a link's next finish is a safe bound.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from policies.routers import LeastKVUsage
from testbed.core import EngineCore
from testbed.core.cluster import ClusterCore
from testbed.core.kv_faults import KVFaults
from testbed.core.routing import Decider, Router
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
        self.num_prefill = num_prefill
        self.decider = decider  # None: every request disaggregated (the core's default)
        self.pairing = pairing or LeastKVUsage()
        super().__init__(
            requests, make_engine, latency_model, num_prefill + num_decode, router, **kwargs
        )
        self.transfers = KVTransfers(
            self.env,
            self.replicas,
            link,
            kv_bytes_per_token,
            lambda i, rid: self.replicas[i].engine.scheduler.requests[rid],
            lambda src, leg: self.apply(self.core.transfer_failed(src, leg)),
            faults,
            timeout_s,
        )
        for i, rep in enumerate(self.replicas):
            rep.engine.executor.kv_transfers = lambda meta, i=i: self.transfers.start(i, meta)
        # No step is shorter (latency models are monotone in every feature).
        self.min_step_s = latency_model.predict(1, 1, 1.0, 1, 1)
        speed = getattr(self.replicas[0].engine.executor, "speed", None)
        if speed is not None:
            self.min_step_s *= speed.min_factor

    def make_core(self, router, probes=None) -> ClusterCore:
        return ClusterCore(
            probes or self.replicas, router, self.num_prefill, self.decider, self.pairing
        )

    @property
    def num_disaggregated(self) -> int:
        return self.core.num_disaggregated

    def next_event_time(self, replica: Replica) -> float:
        return self.core.next_event_time(
            replica.index,
            self.dispatcher.next_arrival_time,
            self.transfers.next_event_time,
            self._step_end,
            self.min_step_s,
        )

    def _step_end(self, replica: int) -> tuple[float, bool]:
        """When ``replica``'s step under way ends, and whether requests finish with it."""
        rep = self.replicas[replica]
        return rep.step_end, rep.finishing

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
