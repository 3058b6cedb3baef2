"""One cluster config makes the same decisions in both modes: the cluster core
(:mod:`testbed.core.cluster`) replayed under the simulator's transport and under
the real cluster's (its parent, :class:`testbed.engine.cluster.Parent`, reading
each worker's KV usage and prefix cache from the messages a worker sends, with
requests pickled on their way as between processes), the engines faked by
simulated ones: every routing, decider and pairing decision is the same, and so
is every request's finish time."""

from __future__ import annotations

import pickle

import pytest

from policies.deciders import DECIDERS, make_decider
from policies.routers import ROUTERS, make_router
from testbed.core import EngineCore, KVCacheManager, Scheduler, SchedulerConfig
from testbed.core.kv_cache import PrefixCacheMirror
from testbed.core.kv_connector import PDConnector
from testbed.engine.cluster import Parent, ReplicaState
from testbed.engine.worker import kv_message, step_message
from testbed.sim.disagg import DisaggSimulation
from testbed.sim.executor import SimExecutor
from testbed.sim.link import LinkSpec
from testbed.sim.simulator import Simulation
from tests.sim.helpers import latency_model, random_requests


def clone(request):
    """A request as a worker process gets it, or sends it back."""
    return pickle.loads(pickle.dumps(request))


class AliveProcess:
    exitcode = None

    def is_alive(self) -> bool:
        return True


class Inbox:
    """A worker's queue: what the parent puts there reaches the simulated replica."""

    def __init__(self, sim, index: int) -> None:
        self.sim, self.index = sim, index

    def put(self, msg) -> None:
        kind = msg[0]
        if kind != "add":
            raise AssertionError(f"unexpected message to a worker: {msg}")
        for req in msg[1]:
            self.sim.replicas[self.index].deliver(clone(req))


def real_transport(cls):
    """``cls`` (a simulation class) with its cluster core driven as the real
    cluster drives it: through the parent, whose probes are the workers' reports."""

    class RealTransport(cls):
        def make_core(self, router, probes=None):
            kv = self.replicas[0].engine.scheduler.kv
            self.states = [
                ReplicaState(
                    i,
                    AliveProcess(),
                    Inbox(self, i),
                    None,
                    PrefixCacheMirror(kv.block_size, kv.enable_prefix_caching),
                )
                for i in range(len(self.replicas))
            ]
            core = super().make_core(router, self.states)
            self.parent = Parent(core, self.states, lambda: self.env.now)
            for rep in self.replicas:
                self._wire(rep)
            return core

        def _wire(self, rep) -> None:
            """Make the replica report as a worker does: after each step, and when a
            transfer changes its KV cache between steps."""
            engine, sched, i = rep.engine, rep.engine.scheduler, rep.index
            sched.kv.record_events()
            step, update = engine.step, sched.update_connector_output

            def stepped():
                res = step()
                self.parent.handle(step_message(i, res, sched))
                return res

            def updated(*args, **kwargs):
                out = update(*args, **kwargs)
                self.parent.handle(kv_message(i, sched))
                return out

            engine.step, sched.update_connector_output = stepped, updated

        def route(self, request, now):
            self.parent.apply(self.core.arrive(request, now))

        def on_finished(self, replica, finished):
            for req in finished:
                self.parent.handle(("done", replica, clone(req)))
            self.num_finished = len(self.parent.final)
            if self.core.idle and self.dispatcher.done:
                for rep in self.replicas:
                    rep.wake()

    return RealTransport


def replay(transport, router, requests, replicas=3, num_prefill=0, decider=None, pairing=None):
    """The decisions and finish times of one replay of ``requests``."""
    lat = latency_model()

    def make_engine(i, clock):
        kv = KVCacheManager(3000, 16, True)  # small: evictions happen
        connector = None
        if num_prefill:
            connector = PDConnector("producer" if i < num_prefill else "consumer", i)
        cfg = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=64, max_model_len=8192)
        return EngineCore(Scheduler(cfg, kv, make_policy(), connector), SimExecutor(lat), clock)

    common = dict(router=make_router(router), fast_forward=transport == "sim")
    if transport == "real":
        cls = real_transport(DisaggSimulation if num_prefill else Simulation)
    else:
        cls = DisaggSimulation if num_prefill else Simulation
    if num_prefill:
        sim = cls(
            requests,
            make_engine,
            lat,
            num_prefill,
            replicas - num_prefill,
            LinkSpec("test", 1e-4, 5e9),
            131072.0,
            decider=make_decider(**decider) if decider else None,
            pairing=make_router(pairing) if pairing else None,
            **common,
        )
    else:
        sim = cls(requests, make_engine, lat, num_replicas=replicas, **common)
    sim.core.decisions = []
    result = sim.run()
    assert not result.partial, result.stop_reason
    ended = sim.parent.final.values() if transport == "real" else result.requests
    return sim.core.decisions, sorted((r.request_id, r.finish_time) for r in ended)


def make_policy():
    from policies import make_policy as make

    return make("fcfs")


def assert_same(**setup) -> None:
    decisions, finishes = replay("sim", **setup, requests=random_requests(150, rate=12))
    for transport in ("stepped", "real"):
        d, f = replay(transport, **setup, requests=random_requests(150, rate=12))
        assert d == decisions, f"{transport}: first differs at {first_difference(d, decisions)}"
        assert f == finishes
    assert len(finishes) == 150


def first_difference(a, b):
    i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return i, a[i : i + 1], b[i : i + 1]


@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_every_router_decides_alike_in_both_transports(router):
    assert_same(router=router)


@pytest.mark.parametrize("decider", sorted(DECIDERS))
@pytest.mark.parametrize("pairing", ["least_kv_usage", "prefix_cache"])
def test_every_decider_and_pairing_decides_alike_in_both_transports(decider, pairing):
    args = {"threshold": 1024} if decider == "uncached_prompt" else {}
    assert_same(
        router="least_outstanding",
        replicas=4,
        num_prefill=2,
        decider={"name": decider, **args},
        pairing=pairing,
    )
