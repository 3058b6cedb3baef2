"""The simulator's data side of KV transfers: each load a decode instance's
connector asks for (``PDMetadata``) moves over the link between the two
instances (:class:`~testbed.sim.link.Link`, one per ordered pair), and as it
ends both schedulers hear of it (the decode side's request runs, the prefill
side's blocks are freed) and both replicas wake.

A transfer struck by an injected fault (:class:`~testbed.core.kv_faults.KVFaults`)
fails after the link's latency (``fail``) or at the receive's timeout (``hang``):
the decode side recomputes the prompt, the prefill side frees the blocks."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import simpy

from testbed.core.kv_connector import KVLoad, PDMetadata
from testbed.core.kv_faults import KVFaults
from testbed.core.request import Request
from testbed.sim.link import Link, LinkSpec


class KVTransfers:
    """Moves KV between replicas on simulated time.

    ``replicas``: the simulation's replicas (``engine.scheduler``, ``wake()``);
    ``bytes_per_token``: the model's KV bytes per token; ``release``: called with
    (prefill replica, leg id) when a load fails; ``faults``: those to inject;
    ``timeout_s``: when a receive that has not ended fails."""

    def __init__(
        self,
        env: simpy.Environment,
        replicas,
        spec: LinkSpec,
        bytes_per_token: float,
        requests: Callable[[int, str], Request],
        release: Callable[[int, str], object],
        faults: KVFaults | None = None,
        timeout_s: float = float("inf"),
    ) -> None:
        self.env, self.replicas, self.spec = env, replicas, spec
        self.bytes_per_token = bytes_per_token
        self._request = requests  # (replica, request id) -> the request there
        self.faults, self.timeout_s = faults or KVFaults(), timeout_s
        # (replica, leg id): what a failed load's prefill side does (the cluster
        # core's decision, carried out by the simulation).
        self._release = release
        self.links: dict[tuple[int, int], Link] = {}
        self._version: dict[tuple[int, int], int] = {}
        self._done: dict[tuple[int, int], dict[str, tuple[int, KVLoad]]] = {}
        # Not on a link yet (in their latency, or hanging): (src, dst, when that ends).
        self._joining: list[tuple[int, int, float]] = []

    def start(self, replica: int, meta: PDMetadata) -> None:
        """The loads ``replica``'s connector asked for in this step: each starts now."""
        for load in meta.loads:
            self.env.process(self._transfer(replica, load))

    def _transfer(self, dst: int, load: KVLoad):
        src = load.remote_instance
        req = self._request(dst, load.request_id)
        nbytes = load.num_tokens * self.bytes_per_token
        req.kv_transfer_start = self.env.now
        fault = self.faults.strikes(load.request_id)
        wait = self.timeout_s if fault == "hang" else self.spec.latency_s
        joining = (src, dst, self.env.now + wait)
        self._joining.append(joining)
        yield self.env.timeout(wait)
        self._joining.remove(joining)
        if fault is not None:
            self._fail(dst, load)
            return
        req.kv_transfer_bytes = int(nbytes)
        pair = (src, dst)
        link = self.links.get(pair)
        if link is None:
            link = self.links[pair] = Link(self.spec)
            link.now = self.env.now
            self._version[pair], self._done[pair] = 0, {}
        link.advance(self.env.now)
        link.add(load.request_id, nbytes)
        self._done[pair][load.request_id] = (dst, load)
        self._reschedule(pair)

    def _reschedule(self, pair: tuple[int, int]) -> None:
        """After a change on ``pair``'s link: wake at its next finish (earlier wakes
        for an older state are ignored by their version)."""
        self._version[pair] += 1
        at = self.links[pair].next_finish()
        if at < float("inf"):
            self.env.process(self._wake(pair, self._version[pair], at))

    def _wake(self, pair: tuple[int, int], version: int, at: float):
        yield self.env.timeout(max(0.0, at - self.env.now))
        if self._version[pair] != version:
            return
        link = self.links[pair]
        link.advance(self.env.now)
        for rid in link.pop_finished():
            dst, load = self._done[pair].pop(rid)
            self._finish(dst, load)
        self._reschedule(pair)

    def _finish(self, dst: int, load: KVLoad) -> None:
        now = self.env.now
        req = self._request(dst, load.request_id)
        req.kv_transfer_end = now
        decode, prefill = self.replicas[dst], self.replicas[load.remote_instance]
        decode.engine.scheduler.update_connector_output((), {load.request_id}, now)
        prefill.engine.scheduler.update_connector_output({load.remote_request_id}, (), now)
        decode.wake()
        prefill.wake()

    def _fail(self, dst: int, load: KVLoad) -> None:
        now = self.env.now
        self._request(dst, load.request_id).kv_transfer_end = now
        decode, prefill = self.replicas[dst], self.replicas[load.remote_instance]
        decode.engine.scheduler.update_connector_output((), (), now, {load.request_id})
        self._release(load.remote_instance, load.remote_request_id)
        decode.wake()
        prefill.wake()

    def next_event_time(self, replica: int) -> float:
        """The earliest a transfer into or out of ``replica`` may end (one joining
        a link later only slows those on it)."""
        t = float("inf")
        for (src, dst), link in self.links.items():
            if replica in (src, dst) and link.remaining:
                t = min(t, link.next_finish())
        for src, dst, join in self._joining:
            if replica in (src, dst):
                t = min(t, join)
        return t

    def metrics(self, duration_s: float) -> dict[str, float]:
        """``metrics.json``'s link fields (the transfers' own, from the request
        records, are every mode's: ``testbed.metrics.summary``)."""
        links = list(self.links.values())
        util = [link.busy_s / duration_s for link in links] if duration_s > 0 else []
        return {
            "kv_link": self.spec.name,
            "kv_link_utilization_mean": float(np.mean(util)) if util else 0.0,
            "kv_link_utilization_max": float(np.max(util)) if util else 0.0,
        }
