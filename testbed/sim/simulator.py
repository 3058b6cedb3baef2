"""The discrete-event simulation: replicas, a dispatcher with a router, simpy time.

Entities: a :class:`Dispatcher` (arrivals in trace order, handed to the cluster
core when their time comes) and one :class:`Replica` process per engine
instance, each running the shared :class:`EngineCore` with a
:class:`SimExecutor`. Events: arrivals, and step ends (a step lasts its
predicted latency). Where a request goes is decided by the
:class:`~testbed.core.cluster.ClusterCore` the real cluster uses too; this
module is its transport on simulated time, and takes the bound on its jumps
from the core (:meth:`~testbed.core.cluster.ClusterCore.next_event_time`).

Arrival order is deterministic: before a replica starts a step it has the
dispatcher route every arrival due by then, so an arrival at time ``t`` is seen
by every step that starts at or after ``t``, whatever simpy's order of equal-time
events. Between events, plain decode steps are applied in jumps (see
``testbed.core.fast_forward``) with results identical to stepping one by one.

In a closed loop (``max_concurrency`` clients, :class:`ClosedLoopDispatcher`) a
finish sends its client's next request at the finish's time, and the fast path
stays exact: the replica that reports a finish routes what it sends before its
own next step; a jump ends at its first finish; with several replicas, one about
to step first lets every other whose step ends then report (so what is sent at a
moment does not hang on simpy's order of equal-time events), and one whose jumps
a delivery does not cut steps one step at a time (its jump could pass another
replica's finish, and so a request sent then that a decision reads it for).
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import math
import time
from array import array
from collections.abc import Callable, Sequence

import numpy as np
import simpy

from policies.routers import RoundRobin
from testbed.core import EngineCore, Request
from testbed.core.cluster import Action, ClusterCore, Deliver, Finish, Release
from testbed.core.fast_forward import advance_decode, decode_horizon, decode_usage
from testbed.core.policy import warn_of_costs
from testbed.core.request import SERVED
from testbed.metrics import RunResult, StepLog
from testbed.metrics.gaps import PooledGaps
from testbed.metrics.records import RequestRecords
from testbed.sim.latency import decode_latencies
from testbed.sim.speed import SpeedTrace
from testbed.workload import ClosedLoop, RequestStream

MAX_JUMP = 4096  # steps per jump at most (bounds the arrays built per jump)


def delay_to(now: float, target: float) -> float:
    """A delay that simpy adds to ``now`` to land exactly on ``target`` (``target -
    now`` alone may miss it by an ulp, and stepping would land on it exactly)."""
    d = target - now
    while now + d < target:
        d = math.nextafter(d, math.inf)
    while now + d > target:
        d = math.nextafter(d, -math.inf)
    return d


class Replica:
    """One engine instance as a simpy process."""

    def __init__(self, sim: Simulation, index: int, engine: EngineCore) -> None:
        self.sim, self.index, self.engine = sim, index, engine
        self.inbox: list[Request] = []
        self.idle: simpy.Event | None = None
        # While a step runs: when it ends, and whether requests finish with it.
        self.step_end = math.inf
        self.finishing = False
        # Whether a delivery may cut its jumps short (set by the simulation), and
        # while one waits to be applied its steps' start times (kv_usage meanwhile
        # counts the blocks of the step under way).
        self.interruptible = False
        self.jumps = True  # whether the fast path may jump (see the module docstring)
        self.process: simpy.Process | None = None
        self._cuttable = False
        self._plan: np.ndarray | None = None
        self._plan_usage: list[int] | None = None  # its steps' blocks in use, once read

    def deliver(self, request: Request) -> None:
        self.inbox.append(request)
        if self._cuttable:  # in a jump: it ends with the step under way
            self._cuttable = False
            self.process.interrupt()
        else:
            self.wake()

    @property
    def kv_usage(self) -> float:
        kv = self.engine.scheduler.kv
        if self._plan is None:
            return kv.usage
        if self._plan_usage is None:  # asked once per jump, if at all
            self._plan_usage = decode_usage(self.engine.scheduler, len(self._plan))
        # The step under way now (the last started) has allocated its blocks.
        i = bisect.bisect_right(self._plan, self.sim.env.now) - 1
        return self._plan_usage[min(max(i, 0), len(self._plan) - 1)] / kv.num_blocks

    def prefix_hit_tokens(self, request: Request) -> int:
        """Tokens of ``request``'s prompt this replica's prefix cache holds now."""
        return self.engine.scheduler.prefix_hit_tokens(request)

    def wake(self) -> None:
        """Let the replica look again if it waits for an event (an arrival, KV)."""
        if self.idle is not None and not self.idle.triggered:
            self.idle.succeed()

    def run(self):
        sim, env, engine = self.sim, self.sim.env, self.engine
        sched = engine.scheduler
        log, latency_model = sim.steps, sim.latency_model
        while True:
            if sim.settles_ends and sim.ends_pending(self):
                yield env.timeout(0)  # after theirs: they report their finishes first
                continue
            sim.dispatcher.dispatch_until(env.now)
            if self.inbox:
                rejected = False
                for req in self.inbox:
                    if not engine.add_request(req):
                        self._finished([req])
                        rejected = True
                self.inbox.clear()
                if rejected and sim.closed_loop:
                    continue  # the rejection freed a client now: send its next first
            if not engine.has_unfinished_requests():
                if sim.arrivals_done():
                    return
                self.idle = env.event()
                yield self.idle
                self.idle = None
                continue
            if sim.fast_forward and self.jumps and (k := decode_horizon(sched, MAX_JUMP)) > 0:
                if self.interruptible:
                    yield from self._cuttable_jump(k, sched, log, latency_model)
                else:
                    yield from self._jump(k, sched, log, latency_model)
                continue
            res = engine.step()
            log.add_result(self.index, res)
            if res.latency_s > 0:
                self.step_end, self.finishing = env.now + res.latency_s, bool(res.finished)
                yield env.timeout(res.latency_s)
                self.step_end, self.finishing = math.inf, False
            elif res.num_reqs == 0:
                # Nothing schedulable (e.g. KV arriving): wait for the next event.
                self.idle = env.event()
                yield self.idle
                self.idle = None
            if res.finished:
                self._finished(res.finished)

    def _jump(self, k: int, sched, log: StepLog, latency_model):
        """Apply plain decode steps up to the next arrival: a run of up to ``k``, and
        after a run that ends in completions, the next run if there is one (one simpy
        event for all; nothing outside this replica can tell the difference, since
        only arrivals look at other replicas)."""
        env = self.sim.env
        now, next_arrival = env.now, self.sim.next_event_time(self)
        t = now
        while True:
            t, finished = self._decode_run(k, t, next_arrival, sched, log, latency_model)
            if not finished or t >= next_arrival:
                break
            # Finished before the next arrival, the only event that looks at this
            # replica's count, so counting them now is the same as at their time.
            self._finished(finished)
            finished = []
            if self.sim.closed_loop:  # a client freed at t: its next request arrives then
                next_arrival = self.sim.next_event_time(self)
                if t >= next_arrival:
                    break
            k = decode_horizon(sched, MAX_JUMP)
            if k == 0:
                break
        yield env.timeout(delay_to(now, t))
        if self.sim.closed_loop:  # what a finish sent is due at t, which one hop may miss
            while env.now < t:
                yield env.timeout(delay_to(env.now, t))
        if finished:
            self._finished(finished)

    def _cuttable_jump(self, k: int, sched, log: StepLog, latency_model):
        """One run of up to ``k`` plain decode steps, up to the next event that may
        change this replica from outside (not one that only reads it: its KV usage
        is read from the planned steps until they are applied). As stepping does,
        the steps are applied as the last one starts; a delivery before then cuts
        the run after the step under way (those that started before it)."""
        env = self.sim.env
        now = env.now
        times, lat, m, shape = self._plan_run(
            k, now, self.sim.next_event_time(self), sched, latency_model
        )
        if m > 1:
            self._plan = times[:m]
            self._cuttable = True
            try:
                yield env.timeout(delay_to(now, times[m - 1]))
            except simpy.Interrupt:
                m = max(1, int(np.searchsorted(times[:m], env.now, side="left")))
            self._cuttable = False
            self._plan = None
        usage, self._plan_usage = self._plan_usage, None
        finished = self._apply_run(times, lat, m, shape, sched, log, usage)
        end = times[m]
        self.step_end, self.finishing = end, bool(finished)
        while env.now < end:  # the step under way (a delivery: read as it ends)
            with contextlib.suppress(simpy.Interrupt):
                yield env.timeout(delay_to(env.now, end))
        self.step_end, self.finishing = math.inf, False
        if finished:
            self._finished(finished)

    def _decode_run(self, k, t, next_arrival, sched, log, latency_model):
        """Up to ``k`` decode steps from time ``t``, none starting at or after the
        next arrival (the first always runs). Returns the end time and who finished."""
        times, lat, m, shape = self._plan_run(k, t, next_arrival, sched, latency_model)
        finished = self._apply_run(times, lat, m, shape, sched, log)
        return float(times[m]), finished

    def _plan_run(self, k, t, next_arrival, sched, latency_model):
        """The times of up to ``k`` decode steps from ``t``, none starting at or after
        ``next_arrival`` (the first always runs): step boundaries ``times`` (``m +
        1``), latencies, how many run ``m``, and the batch's shape."""
        n = len(sched.running)
        # The executor's speed trace (if any) applies to the fast path's steps too.
        speed: SpeedTrace | None = getattr(self.engine.executor, "speed", None)
        counts = [r.num_computed_tokens for r in sched.running]
        ctx, longest = sum(counts), max(counts)
        if next_arrival < float("inf"):
            # Steps only get longer as contexts grow: the first bounds how many fit.
            first = latency_model.predict(n, n, float(ctx + n), ctx + n, longest + 1)
            if speed is not None:
                first *= speed.min_factor
            k = min(k, int((next_arrival - t) / first) + 2)
        lat = decode_latencies(latency_model, n, ctx, k, longest)
        if speed is not None:
            lat = speed.scale(t, lat)
        times = np.empty(len(lat) + 1)
        times[0] = t
        times[1:] = lat
        np.cumsum(times, out=times)  # sequential sums: the same floats as stepping
        # Step j (j >= 1) runs only if it starts before the next arrival.
        m = 1 + int(np.searchsorted(times[1:-1], next_arrival, side="left"))
        return times, lat, m, (n, ctx, longest)

    def _apply_run(self, times, lat, m, shape, sched, log, usage=None):
        """Apply the first ``m`` planned steps and log them; who finished."""
        n, ctx, longest = shape
        ends = times[1 : m + 1]
        used, finished = advance_decode(sched, array("d", ends.tobytes()), usage)
        log.add_decode_steps(
            self.index,
            times[:m],
            lat[:m],
            n,
            np.asarray(used, dtype=np.float64) / sched.kv.num_blocks,
            len(sched.waiting),
            n - len(finished),
            ctx + n * np.arange(1, m + 1, dtype=np.int64),  # what decode_latencies read
            longest + np.arange(1, m + 1, dtype=np.int64),
        )
        self.sim.num_jumps += 1
        self.sim.num_jumped_steps += m
        return finished

    def _finished(self, finished: Sequence[Request]) -> None:
        self.sim.on_finished(self.index, finished)


class Dispatcher:
    """Hands arrivals to the cluster core at their arrival time (a simpy process).

    Takes requests in arrival order (a stable sort of a list; a
    :class:`RequestStream` makes them in that order as they are reached) and
    knows each dispatched, unfinished one by id with its row in the trace."""

    def __init__(self, sim: Simulation, requests: Sequence[Request] | RequestStream) -> None:
        self.sim = sim
        if isinstance(requests, RequestStream):
            self._source = iter(requests)
        else:
            order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_time)
            self._source = ((i, requests[i]) for i in order)
        self._next = next(self._source, None)
        self.in_flight: dict[str, tuple[int, Request]] = {}

    @property
    def done(self) -> bool:
        return self._next is None

    @property
    def next_arrival_time(self) -> float:
        return self._next[1].arrival_time if self._next is not None else float("inf")

    def dispatch_until(self, now: float) -> None:
        while self._next is not None and self._next[1].arrival_time <= now:
            row, req = self._next
            self._next = next(self._source, None)
            self.in_flight[req.request_id] = (row, req)
            self.sim.route(req, now)

    def undispatched(self):
        """``(row, request)`` of every request not dispatched yet (consumes them)."""
        if self._next is not None:
            yield self._next
            self._next = None
            yield from self._source

    def ended(self, requests: Sequence[Request], now: float) -> None:
        """Requests that ended for their users, reported at ``now`` (an open loop's
        arrivals do not depend on them)."""

    def run(self):
        env = self.sim.env
        while not self.done:
            delay = self.next_arrival_time - env.now
            if delay > 0:
                yield env.timeout(delay)
            self.dispatch_until(env.now)
        self.wake_idle()

    def wake_idle(self) -> None:
        """Let idle replicas see that arrivals are over."""
        for rep in self.sim.replicas:
            if rep.idle is not None and not rep.idle.triggered:
                rep.idle.succeed()


class ClosedLoopDispatcher(Dispatcher):
    """Hands a closed loop's requests to the cluster core as clients free
    (:class:`~testbed.workload.ClosedLoop`): the first ``max_concurrency`` at 0,
    each later one when a request ends (reported through :meth:`ended`). The
    replica that reports an end reaches its next step at that end's time and
    routes what is due first, so this process only sends the first ones and,
    once every request is sent, lets idle replicas see it."""

    def __init__(
        self, sim: Simulation, requests: Sequence[Request] | RequestStream, max_concurrency: int
    ) -> None:
        self.sim = sim
        rows = requests.in_rows() if isinstance(requests, RequestStream) else enumerate(requests)
        self.loop = ClosedLoop(rows, max_concurrency)
        self.in_flight: dict[str, tuple[int, Request]] = {}
        self._all_sent: simpy.Event | None = None

    @property
    def done(self) -> bool:
        return self.loop.done

    @property
    def next_arrival_time(self) -> float:
        return self.loop.next_time

    def dispatch_until(self, now: float) -> None:
        for row, req in self.loop.send(now):
            self.in_flight[req.request_id] = (row, req)
            self.sim.route(req, now)
        if self.loop.done and self._all_sent is not None and not self._all_sent.triggered:
            self._all_sent.succeed()

    def undispatched(self):
        return self.loop.unsent()

    def ended(self, requests: Sequence[Request], now: float) -> None:
        for req in requests:
            self.loop.ended(req, now)

    def run(self):
        self.dispatch_until(self.sim.env.now)
        if not self.done:
            self._all_sent = self.sim.env.event()
            yield self._all_sent
        self.wake_idle()


class Simulation:
    """Replays requests through ``num_replicas`` engines on simulated time.

    Given a list, it returns the list's requests as they ended; given a
    :class:`RequestStream`, it makes each request as its arrival comes, records it
    (:class:`RequestRecords`) when it finishes and lets it go, and returns the
    records: a million-request run holds only the requests in flight."""

    def __init__(
        self,
        requests: Sequence[Request] | RequestStream,
        make_engine: Callable[[int, Callable[[], float]], EngineCore],
        latency_model,
        num_replicas: int = 1,
        router=None,
        fast_forward: bool = True,
        on_progress: Callable[[float, int], None] | None = None,
        max_sim_time_s: float | None = None,
        keep_tokens: bool = False,
        max_concurrency: int | None = None,
    ) -> None:
        """``keep_tokens``: keep each finished request's token times and stand-in
        output (tests compare them) instead of only their counts and pooled gaps.
        ``max_concurrency``: send the requests in a closed loop of that many
        clients, in their order (None: at their arrival times)."""
        self.env = simpy.Environment()
        self.keep_tokens = keep_tokens
        streamed = isinstance(requests, RequestStream)
        self.requests = requests if streamed else list(requests)
        self.records = RequestRecords() if streamed else None
        self.latency_model = latency_model
        self.fast_forward = fast_forward
        self.steps = StepLog()
        self.num_jumps = self.num_jumped_steps = 0
        self.num_finished = 0
        self.gaps = PooledGaps()
        self.on_progress = on_progress
        self.max_sim_time_s = max_sim_time_s
        clock = lambda: self.env.now  # noqa: E731
        self.replicas = [Replica(self, i, make_engine(i, clock)) for i in range(num_replicas)]
        self.closed_loop = max_concurrency is not None
        if self.closed_loop:
            self.dispatcher = ClosedLoopDispatcher(self, self.requests, max_concurrency)
        else:
            self.dispatcher = Dispatcher(self, self.requests)
        # Whether a replica waits, before it steps, for other replicas' ends at that time.
        self.settles_ends = self.closed_loop and num_replicas > 1
        self.core = self.make_core(router or RoundRobin())
        # A replica that decisions read only through counts and KV usage (read
        # from the planned steps) need not stop its jumps for an arrival that may
        # go elsewhere: one delivered to it cuts them.
        for rep in self.replicas:
            rep.interruptible = self.core.cut_by_delivery(rep.index)
            rep.jumps = not (self.settles_ends and not rep.interruptible)
        if fast_forward:  # what the policy's hooks cost the jumps, said once per class
            warn_of_costs(self.replicas[0].engine.scheduler.policy)

    def make_core(self, router, probes=None) -> ClusterCore:
        """The cluster core, reading each replica's KV usage and cache from it (or
        from ``probes``)."""
        return ClusterCore(probes or self.replicas, router)

    def route(self, request: Request, now: float) -> None:
        """Hand an arrival to the cluster core; carry out what it decides."""
        self.apply(self.core.arrive(request, now))

    def apply(self, actions: list[Action]) -> list[Request]:
        """Carry out the core's actions; the requests that ended for their users."""
        ended = []
        for action in actions:
            kind = type(action)
            if kind is Deliver:
                self.replicas[action.replica].deliver(action.request)
            elif kind is Finish:
                ended.append(action.request)
            elif kind is Release:  # both ends are here: the caller wakes them
                sched = self.replicas[action.replica].engine.scheduler
                sched.update_connector_output({action.leg_id}, (), self.env.now)
            else:
                raise AssertionError(f"no replica of a simulation is lost: {action}")
        return ended

    def arrivals_done(self) -> bool:
        """Whether no request will reach a replica any more."""
        return self.dispatcher.done and self.core.idle

    def ends_pending(self, replica: Replica) -> bool:
        """Whether another replica's step (or jump) ends now and has not reported."""
        now = self.env.now
        return any(rep.step_end <= now for rep in self.replicas if rep is not replica)

    def next_event_time(self, replica: Replica) -> float:
        """The earliest time anything outside ``replica`` may look at it or change
        it (for one whose jumps a delivery cuts: change it otherwise): its fast
        path's jumps stop before then. The rule is the cluster core's."""
        return self.core.next_event_time(replica.index, self.dispatcher.next_arrival_time)

    def on_finished(self, replica: int, finished: Sequence[Request]) -> None:
        """Requests back from ``replica``: the core says who has ended (and where a
        finished prefill leg's request goes on)."""
        ended = self.apply(self.core.finish(replica, finished, self.env.now))
        if ended:
            self.record_finished(ended)
        if self.core.disaggregated and self.core.idle and self.dispatcher.done:
            for rep in self.replicas:  # those waiting for more may stop
                rep.wake()

    def record_finished(self, finished: Sequence[Request]) -> None:
        """Count them, pool the finished ones' token gaps and keep only counts of
        their tokens (memory stays per request, not per token)."""
        self.num_finished += len(finished)
        self.dispatcher.ended(finished, self.env.now)
        in_flight = self.dispatcher.in_flight
        for req in finished:
            if req.status in SERVED:
                self.gaps.add(req.token_times)
            entry = in_flight.pop(req.request_id, None)
            if self.records is not None:  # a stream's ids are its rows': never repeated
                self.records.add(req, entry[0])
            elif not self.keep_tokens:
                req.keep_counts_only()
        if self.on_progress is not None:
            self.on_progress(self.env.now, self.num_finished)

    def run(self) -> RunResult:
        start = time.perf_counter()
        env = self.env
        env.process(self.dispatcher.run())
        for rep in self.replicas:
            rep.process = env.process(rep.run())
        partial, reason, error = False, "finished", None
        # The loop allocates millions of small objects but makes no reference
        # cycles: the cyclic collector would only rescan a growing heap.
        gc_enabled = gc.isenabled()
        gc.disable()
        try:
            env.run(until=self.max_sim_time_s)
            if self.num_finished < len(self.requests):
                partial, reason = True, f"stopped at max_sim_time_s={self.max_sim_time_s}"
        except KeyboardInterrupt as e:  # the caller re-raises it once the run is written
            partial, reason, error = True, "interrupted", e
        except Exception as e:  # keep what was measured; the caller re-raises
            partial, reason, error = True, f"error: {e!r}", e
        finally:
            if gc_enabled:
                gc.enable()
        if self.records is not None:  # the rest as they are: in flight, not arrived
            for row, req in [*self.dispatcher.in_flight.values(), *self.dispatcher.undispatched()]:
                self.records.add(req, row)
            self.dispatcher.in_flight.clear()
        elif self.closed_loop:
            for _ in self.dispatcher.undispatched():  # never sent: marked as never arrived
                pass
        return RunResult(
            requests=self.records if self.records is not None else self.requests,
            steps=self.steps,
            duration_s=env.now,
            wall_s=time.perf_counter() - start,
            num_jumps=self.num_jumps,
            num_jumped_steps=self.num_jumped_steps,
            partial=partial,
            stop_reason=reason,
            error=error,
            gaps=self.gaps,
            extra={
                "num_finished_reported": self.num_finished,
                "outstanding": self.core.num_outstanding(),
            },
        )
