"""Earliest deadline first, on the time-to-first-token SLO.

EDF (Liu & Layland 1973) is optimal for meeting deadlines on one server when
the load is feasible; SLO-aware LLM schedulers build on it. A request's
deadline is its arrival plus its TTFT SLO; requests without an SLO go last.
With ``reject_late``, a request whose deadline has already passed when it
reaches the head of the queue is rejected instead of served late (it could only
take capacity from requests that can still make theirs).
"""

import math

from testbed.core.policy import ADMIT, Admission, Decision, Policy
from testbed.core.request import Request


class EDF(Policy):
    """Earliest TTFT deadline first."""

    name = "edf"

    def __init__(self, reject_late: bool = False, victim: str | None = None) -> None:
        super().__init__(victim)
        self.reject_late = reject_late
        if reject_late:  # bound only when on: without an admit hook the simulator's fast path stays
            self.admit = self.reject_if_late

    @staticmethod
    def deadline(request: Request) -> float:
        if request.ttft_slo_s is None:
            return math.inf
        return request.arrival_time + request.ttft_slo_s

    def key(self, request: Request, now: float) -> float:
        return self.deadline(request)

    def reject_if_late(self, request: Request, now: float) -> Admission:
        """The admission decision with ``reject_late``."""
        if request.num_output_tokens == 0 and now > self.deadline(request):
            late = now - self.deadline(request)
            return Admission(Decision.REJECT, f"TTFT deadline passed {late:.3f}s before admission")
        return ADMIT
