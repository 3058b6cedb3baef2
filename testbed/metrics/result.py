"""What a run hands to metrics and reporting, in either mode."""

from __future__ import annotations

from dataclasses import dataclass, field

from testbed.core import Request
from testbed.core.request import SERVED
from testbed.metrics.gaps import PooledGaps
from testbed.metrics.records import RequestRecords
from testbed.metrics.steplog import StepLog


@dataclass
class RunResult:
    # The requests as they ended, or (a simulation fed a stream) their records.
    requests: list[Request] | RequestRecords
    steps: StepLog
    duration_s: float  # the run's clock at the end (simulated or wall)
    wall_s: float
    num_jumps: int = 0  # simulator fast path
    num_jumped_steps: int = 0
    partial: bool = False
    stop_reason: str = "finished"
    # What stopped the run early: an exception, or the interrupt (Ctrl-C, SIGTERM).
    error: BaseException | None = None
    extra: dict = field(default_factory=dict)
    # The finished requests' inter-token gaps (the simulator pools them as requests
    # finish and frees their token times; None: take them from the requests).
    gaps: PooledGaps | None = None

    def itl_gaps(self) -> PooledGaps:
        if self.gaps is None:
            self.gaps = PooledGaps.of(r.token_times for r in self.requests if r.status in SERVED)
        return self.gaps
