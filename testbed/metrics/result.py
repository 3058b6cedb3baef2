"""What a run hands to metrics and reporting, in either mode."""

from __future__ import annotations

from dataclasses import dataclass, field

from testbed.core import Request
from testbed.metrics.steplog import StepLog


@dataclass
class RunResult:
    requests: list[Request]
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
