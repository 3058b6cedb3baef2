"""Shortest job first on the output length, with aging.

Output length dominates a request's service time, and ordering by it lowers
mean latency (e.g. Fu et al., "Efficient LLM Scheduling by Learning to Rank",
NeurIPS 2024; Qiu et al., "Efficient Interactive LLM Serving with Proxy
Model-based Sequence Length Prediction", 2024). ``length="oracle"`` reads the
trace's true output length (an upper bound on what prediction can reach);
``length="predicted"`` reads ``Request.predicted_output_tokens`` (a length
predictor's guess), falling back to ``max_tokens``. Aging subtracts
``aging_tokens_per_s`` tokens of job size per second waited, so long jobs
cannot starve. Non-preemptive.
"""

from testbed.core.policy import Policy
from testbed.core.request import Request

LENGTHS = ("oracle", "predicted")


def output_length(request: Request, source: str) -> float:
    """The job's output length as ``source`` sees it (inf when unknown)."""
    if source == "predicted" and request.predicted_output_tokens is not None:
        return request.predicted_output_tokens
    n = request.target_output_tokens if source == "oracle" else None
    n = n or request.sampling_params.max_tokens
    return float("inf") if n is None else n


class SJF(Policy):
    """Shortest (predicted) output first."""

    name = "sjf"

    def __init__(
        self, length: str = "oracle", aging_tokens_per_s: float = 0.0, victim: str | None = None
    ) -> None:
        super().__init__(victim)
        if length not in LENGTHS:
            raise ValueError(f"length must be one of {LENGTHS}, got {length!r}")
        self.length = length
        self.aging_tokens_per_s = aging_tokens_per_s

    def job_size(self, request: Request) -> float:
        return output_length(request, self.length)

    def key(self, request: Request, now: float) -> float:
        # Aging takes aging x (now - arrival) off every size; aging x now is the same
        # for all, so size + aging x arrival ranks them alike, and does not change
        # while they wait (a static key: the queue stays sorted, no sort per step).
        size = self.job_size(request)
        if self.aging_tokens_per_s:
            size += self.aging_tokens_per_s * request.arrival_time
        return size
