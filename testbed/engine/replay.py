"""Trace replay on the wall clock: the real engine's counterpart of the simulator.

Requests are injected when their arrival time comes (seconds since the replay
started), stamped by the same control-plane code as in simulation, and every
engine step is logged; the run directory is the simulator's.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence

from testbed.core import EngineCore, Request, StepResult, WallClock
from testbed.metrics import RunResult, StepLog


def replay(
    engine: EngineCore,
    requests: Sequence[Request],
    on_progress: Callable[[float, int], None] | None = None,
    max_wall_s: float | None = None,
    on_step: Callable[[StepResult], None] | None = None,
    idle_probe=None,
) -> RunResult:
    """Run ``requests`` through ``engine`` at their arrival times, on its wall clock.
    ``on_step`` sees every step's result (the profiler records them). With an
    ``idle_probe`` (``testbed.profiling.probes.IdleProbe``), the machine's speed is
    sampled while the engine waits for the next arrival: ``extra["idle_probe"]``
    holds (time, seconds) pairs."""
    clock = engine.clock
    if not isinstance(clock, WallClock):
        raise TypeError("replay runs on the wall clock: build the engine with a WallClock")
    clock.reset()
    start = time.perf_counter()
    pending = deque(sorted(requests, key=lambda r: r.arrival_time))
    log = StepLog()
    num_done = 0
    partial, reason, error = False, "finished", None
    samples: list[tuple[float, float]] = []
    last_sample = -float("inf")
    try:
        while pending or engine.has_unfinished_requests():
            now = clock()
            if max_wall_s is not None and now > max_wall_s:
                partial, reason = True, f"stopped at max_wall_s={max_wall_s}"
                break
            while pending and pending[0].arrival_time <= now:
                if not engine.add_request(pending.popleft()):
                    num_done += 1
            if not engine.has_unfinished_requests():
                if pending:  # idle until the next arrival
                    wait = pending[0].arrival_time - clock()
                    if idle_probe is not None and wait > idle_probe.min_gap_s:
                        due = last_sample + idle_probe.every_s - clock()
                        if due <= 0:
                            last_sample = clock()
                            samples.append((last_sample, idle_probe.measure()))
                            continue
                        wait = min(wait, due)
                    time.sleep(max(0.0, wait))
                continue
            res = engine.step()
            if on_step is not None:
                on_step(res)
            log.add_result(0, res)
            if res.finished:
                num_done += len(res.finished)
                if on_progress is not None:
                    on_progress(res.start_s + res.latency_s, num_done)
    except KeyboardInterrupt as e:  # the caller re-raises it once the run is written
        partial, reason, error = True, "interrupted", e
    except Exception as e:  # keep what was measured; the caller re-raises
        partial, reason, error = True, f"error: {e!r}", e
    return RunResult(
        requests=list(requests),
        steps=log,
        duration_s=clock(),
        wall_s=time.perf_counter() - start,
        partial=partial,
        stop_reason=reason,
        error=error,
        extra={"idle_probe": samples} if idle_probe is not None else {},
    )
