"""Skip-join multi-level feedback queue (FastServe).

Wu et al., "Fast Distributed Inference Serving for Large Language Models"
(FastServe), 2023. Level ``i`` has a quantum of ``base_quantum * 2**i`` units
of service; a request is demoted one level each time it uses up its level's
quantum, so long jobs sink and short ones finish fast without knowing output
lengths in advance. Skip-join: a request enters at the highest level whose
quantum covers its prefill (long prompts skip the top levels instead of
wasting them). A decode token is one unit; ``prefill_tokens_per_unit`` prompt
tokens are one unit. A request that waits longer than ``starvation_s`` is
promoted back to the top. Preemptive across levels. Keep ``starvation_s`` well
above a request's service time: a promoted request displaces a running one,
which recomputes from scratch, and with starvation in a few steps requests can
displace each other forever.
"""

from collections.abc import Sequence

from testbed.core.outputs import SchedulerOutput
from testbed.core.policy import Policy
from testbed.core.request import Request


class MLFQ(Policy):
    """Least-served level first; demote on each used-up quantum."""

    name = "mlfq"
    dynamic_key = True
    reorder_running = True
    preemptive = True

    def __init__(
        self,
        num_levels: int = 6,
        base_quantum: float = 8.0,
        prefill_tokens_per_unit: float = 256.0,
        starvation_s: float = 30.0,
        victim: str | None = None,
    ) -> None:
        super().__init__(victim)
        self.quanta = [base_quantum * 2**i for i in range(num_levels)]
        self.prefill_tokens_per_unit = prefill_tokens_per_unit
        self.starvation_s = starvation_s
        self.level: dict[str, int] = {}
        self.used: dict[str, float] = {}  # service used at the current level
        self.last_served: dict[str, float] = {}

    def entry_level(self, request: Request) -> int:
        prefill_units = request.num_prompt_tokens / self.prefill_tokens_per_unit
        for i, q in enumerate(self.quanta):
            if q >= prefill_units:
                return i
        return len(self.quanta) - 1

    def on_arrival(self, request: Request, now: float) -> None:
        rid = request.request_id
        self.level[rid] = self.entry_level(request)
        self.used[rid] = 0.0
        self.last_served[rid] = now

    def key(self, request: Request, now: float) -> tuple[int, float]:
        rid = request.request_id
        if self._starved(rid, now):
            self.level[rid], self.used[rid], self.last_served[rid] = 0, 0.0, now
        return (self.level.get(rid, 0), request.arrival_time)

    def _starved(self, rid: str, now: float) -> bool:
        # As ``now > regroup_at``, to the last bit: the queue's regroup times agree.
        return rid in self.last_served and now > self.last_served[rid] + self.starvation_s

    def group_of(self, request: Request, now: float) -> int:
        """Its level, as ``key`` ranks it: requests of one level wait in arrival order."""
        rid = request.request_id
        return 0 if self._starved(rid, now) else self.level.get(rid, 0)

    def regroup_at(self, request: Request) -> float | None:
        """A waiting request's level changes only when starvation lifts it to the top."""
        rid = request.request_id
        if self.level.get(rid, 0) == 0 or rid not in self.last_served:
            return None
        return self.last_served[rid] + self.starvation_s

    def on_step(self, output: SchedulerOutput, finished: Sequence[Request], now: float) -> None:
        for i, req in enumerate(output.requests):
            n = output.num_scheduled_tokens[i]
            prompt_part = min(n, max(0, req.num_prompt_tokens - output.context_len(i)))
            self._serve(req, prompt_part / self.prefill_tokens_per_unit + (n - prompt_part), now)
        self._forget(finished)

    def on_decode_steps(
        self, requests: Sequence[Request], num_steps: int, finished: Sequence[Request], now: float
    ) -> None:
        for req in requests:  # one unit at a time: the same float sums as step by step
            for _ in range(num_steps):
                self._serve(req, 1.0, now)
        self._forget(finished)

    def _serve(self, req: Request, units: float, now: float) -> None:
        """Charge service to the request's level; demote for each quantum used up."""
        rid = req.request_id
        if rid not in self.level:
            return
        self.used[rid] += units
        self.last_served[rid] = now
        last = len(self.quanta) - 1
        while self.level[rid] < last and self.used[rid] >= self.quanta[self.level[rid]]:
            self.used[rid] -= self.quanta[self.level[rid]]
            self.level[rid] += 1

    def _forget(self, finished: Sequence[Request]) -> None:
        for req in finished:
            for table in (self.level, self.used, self.last_served):
                table.pop(req.request_id, None)
