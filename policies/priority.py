"""Static priorities with optional aging.

vLLM's ``--scheduling-policy priority``: lower ``Request.priority`` first,
arrival order among equals, the lowest-ranked running request preempted first.
Aging (a classic from OS schedulers) lifts a waiting request by one priority
level every ``aging_interval_s`` seconds, so that low priorities cannot starve.
"""

from testbed.core.policy import Policy
from testbed.core.request import Request


class Priority(Policy):
    """Lower ``priority`` first; with aging, waiting time buys priority."""

    name = "priority"
    default_victim = "lowest_rank"

    def __init__(self, aging_interval_s: float = 0.0, victim: str | None = None) -> None:
        super().__init__(victim)
        if aging_interval_s < 0:
            raise ValueError("aging_interval_s must be >= 0")
        self.aging_interval_s = aging_interval_s

    def key(self, request: Request, now: float) -> tuple[float, float]:
        # Aging lifts every request by (now - arrival) / interval levels; now / interval
        # is the same for all, so priority + arrival / interval ranks them alike and
        # does not change while they wait (a static key).
        prio = float(request.priority)
        if self.aging_interval_s > 0:
            prio += request.arrival_time / self.aging_interval_s
        return (prio, request.arrival_time)
