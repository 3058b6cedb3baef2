"""Shortest remaining processing time, preemptive.

SRPT minimises mean response time on one server (Schrage 1968); for LLM
serving the remaining work is the uncomputed prompt plus the output tokens
still to generate (the oracle length from the trace, as in SJF). A waiting
request with less remaining work displaces the running request with the most
when the batch or the cache is full, and running requests are served in
remaining-work order when the token budget cannot cover them all.
"""

from policies.sjf import output_length
from testbed.core.policy import Policy
from testbed.core.request import Request


class SRPT(Policy):
    """Least remaining work first, preempting."""

    name = "srpt"
    preemptive = True
    reorder_running = True

    def __init__(self, length: str = "oracle", victim: str | None = None) -> None:
        super().__init__(victim)
        self.length = length

    def key(self, request: Request, now: float) -> float:
        prompt_left = max(0, request.num_prompt_tokens - request.num_computed_tokens)
        return prompt_left + output_length(request, self.length) - request.num_output_tokens
