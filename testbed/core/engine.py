"""The engine core: schedule, execute, update; one step at a time.

Time is injected. ``clock`` returns the current time on the run's clock: the
wall clock for a real engine, the simulation's clock for the simulator. A
step's tokens are stamped at its end: ``start + latency_s`` when the executor
predicts the latency (simulation), else the clock read once the executor has
sampled them; a measured step's ``latency_s`` also covers the accounting after
it (``update_from_output``), since the next step cannot start before that.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from testbed.core.kv_cache import KVCacheManager
from testbed.core.kv_connector import KVConnector
from testbed.core.outputs import Executor, ExecutorOutput, SchedulerOutput
from testbed.core.policy import Policy
from testbed.core.request import Request
from testbed.core.scheduler import Scheduler, SchedulerConfig
from testbed.core.scheduler_interface import SchedulerInterface


class WallClock:
    """Seconds since the clock was made, from ``time.perf_counter``."""

    def __init__(self, origin: float | None = None) -> None:
        """``origin``: a ``time.perf_counter`` reading to count from (another
        process's clock: the counter is system-wide), default now."""
        self._t0 = time.perf_counter() if origin is None else origin

    def reset(self) -> None:
        """Start counting from zero again (a replay starts its clock at its start)."""
        self._t0 = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self._t0

    @property
    def origin(self) -> float:
        """The ``time.perf_counter`` reading this clock counts from."""
        return self._t0


@dataclass(slots=True)
class StepResult:
    """One engine step, as ``steps.csv`` records it."""

    step_id: int
    start_s: float
    latency_s: float
    num_reqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_preempted: int
    kv_usage: float
    num_waiting: int
    num_running: int
    kv_tokens: int = 0  # K/V entries the step's attention reads (SchedulerOutput.features)
    attn_pairs: float = 0.0  # (query, key) pairs it computes
    max_kv: int = 0  # the most K/V entries one request reads
    num_spec_reqs: int = 0  # speculative decoding: requests verifying drafts in the step
    num_draft_tokens: int = 0  # ... the drafts they verified
    num_accepted_tokens: int = 0  # ... and accepted
    finished: list[Request] = field(default_factory=list)
    scheduler_output: SchedulerOutput | None = None


class EngineCore:
    """Drives one engine instance: ``step()`` = schedule, execute, update. It uses
    only the scheduler's declared surface (:class:`SchedulerInterface`)."""

    def __init__(
        self,
        scheduler: SchedulerInterface,
        executor: Executor,
        clock: Callable[[], float] | None = None,
        validate: Callable[[Request], str | None] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.clock = clock or WallClock()
        # The data plane's own checks of a new request (e.g. token ids within the
        # vocabulary): a reason to reject it, or None.
        self.validate = validate

    @classmethod
    def build(
        cls,
        executor: Executor,
        policy: Policy,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        clock: Callable[[], float] | None = None,
        *,
        config: SchedulerConfig | None = None,
        connector: KVConnector | None = None,
        validate: Callable[[Request], str | None] | None = None,
    ) -> EngineCore:
        """Make a KV-cache manager, a scheduler and an engine core in one call. The
        scheduler's limits: ``config`` (an engine's options made into them by
        :meth:`SchedulerConfig.of`; None: its defaults)."""
        config = config or SchedulerConfig()
        kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        return cls(Scheduler(config, kv, policy, connector), executor, clock, validate)

    def add_request(self, request: Request) -> bool:
        """Queue a request (its ``arrival_time`` is the caller's to set). False: it was
        rejected at once, with ``request.reject_reason`` saying why."""
        now = self.clock()
        reason = self.validate(request) if self.validate is not None else None
        if reason is not None:
            self.scheduler.reject(request, reason, now)
            return False
        return self.scheduler.add_request(request, now)

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort_request(request_id, self.clock())

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> StepResult:
        """Run one step. With nothing to schedule, the executor is not called."""
        sched = self.scheduler
        start = self.clock()
        out = sched.schedule(start)
        _, _, pairs, kv, max_kv = out.features()  # before the update moves computed counts
        kv_usage = sched.kv_usage  # what the step holds, before finished requests free
        measured = False
        if out.requests or out.kv_loads or sched.num_loading:
            result = self.executor.execute(out)
            if result.latency_s is not None:  # predicted (simulation)
                latency = result.latency_s
                end = start + latency
            else:  # on the clock: tokens exist once sampled
                end = self.clock()
                measured = True
        else:
            result, end, latency = ExecutorOutput(sampled_token_ids=[]), start, 0.0
        spec = sched.spec_stats
        verified, drafted, accepted = (
            spec.num_drafts,
            spec.num_draft_tokens,
            spec.num_accepted_tokens,
        )
        finished = sched.update_from_output(out, result, end)
        if measured:
            # The step lasts until the next can start, accounting included, so that
            # a profile of these latencies predicts the engine's whole cycle.
            latency = self.clock() - start
        return StepResult(
            step_id=out.step_id,
            start_s=start,
            latency_s=latency,
            num_reqs=len(out.requests),
            num_prefill_tokens=out.num_prefill_tokens,
            num_decode_tokens=out.num_decode_tokens,
            num_preempted=len(out.preempted_req_ids),
            kv_usage=kv_usage,
            num_waiting=sched.num_waiting,
            num_running=len(sched.running),
            kv_tokens=kv,
            attn_pairs=pairs,
            max_kv=max_kv,
            num_spec_reqs=spec.num_drafts - verified,
            num_draft_tokens=spec.num_draft_tokens - drafted,
            num_accepted_tokens=spec.num_accepted_tokens - accepted,
            finished=finished,
            scheduler_output=out,
        )
