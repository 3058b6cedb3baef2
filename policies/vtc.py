"""Virtual Token Counter: fair share of service across tenants.

Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024. Each
tenant has a counter of the service it received, in weighted tokens (input
tokens weigh ``input_weight``, output tokens ``output_weight``; the paper uses
1 and 2). The waiting request of the tenant with the smallest counter goes
first. A tenant that comes back after an idle spell has its counter lifted to
the smallest counter among backlogged tenants, so idling banks no credit.
"""

from collections import defaultdict
from collections.abc import Sequence

from testbed.core.outputs import SchedulerOutput
from testbed.core.policy import Policy
from testbed.core.request import Request


class VTC(Policy):
    """Least-served tenant first."""

    name = "vtc"
    dynamic_key = True

    def __init__(
        self, input_weight: float = 1.0, output_weight: float = 2.0, victim: str | None = None
    ) -> None:
        super().__init__(victim)
        self.input_weight = input_weight
        self.output_weight = output_weight
        self.counters: defaultdict[str, float] = defaultdict(float)
        self.backlog: defaultdict[str, int] = defaultdict(int)  # unfinished requests
        self._seen: set[str] = set()

    def key(self, request: Request, now: float) -> tuple[float, float]:
        return (self.counters[request.tenant], request.arrival_time)

    def group_of(self, request: Request, now: float) -> str:
        return request.tenant  # one counter per tenant: its requests wait in arrival order

    def on_arrival(self, request: Request, now: float) -> None:
        tenant = request.tenant
        if self.backlog[tenant] == 0:
            active = [self.counters[t] for t, n in self.backlog.items() if n > 0]
            if active:
                self.counters[tenant] = max(self.counters[tenant], min(active))
        self.backlog[tenant] += 1
        self._seen.add(request.request_id)

    def on_step(self, output: SchedulerOutput, finished: Sequence[Request], now: float) -> None:
        counters, w_in, w_out = self.counters, self.input_weight, self.output_weight
        for req, ctx, n in zip(
            output.requests, output.context_lens, output.num_scheduled_tokens, strict=True
        ):
            # Tokens at prompt positions are input; the rest (decodes, drafts) output.
            prompt_part = req.num_prompt_tokens - ctx
            if prompt_part <= 0:
                counters[req.tenant] += w_out * n
            else:
                prompt_part = min(n, prompt_part)
                counters[req.tenant] += w_in * prompt_part + w_out * (n - prompt_part)
        self._forget(finished)

    def on_decode_steps(
        self, requests: Sequence[Request], num_steps: int, finished: Sequence[Request], now: float
    ) -> None:
        # Exactly num_steps additions of output_weight when it is a whole number.
        for req in requests:
            self.counters[req.tenant] += self.output_weight * num_steps
        self._forget(finished)

    def _forget(self, finished: Sequence[Request]) -> None:
        for req in finished:
            if req.request_id in self._seen:
                self._seen.discard(req.request_id)
                self.backlog[req.tenant] -= 1
