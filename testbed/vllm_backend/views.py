"""What a testbed policy sees of a vLLM request, and of vLLM's scheduler.

A policy reads ``testbed.core.Request`` fields; :class:`RequestView` gives the
same names, read live from the vLLM ``Request`` it wraps, plus what vLLM does
not keep: the arrival order, the original priority (the scheduler overwrites
vLLM's ``priority`` with victim ranks), and the per-request data passed in
``SamplingParams.extra_args["testbed"]`` (tenant, TTFT SLO, lengths).
"""

from __future__ import annotations

from typing import Any

# Fields ``extra_args["testbed"]`` may carry, with their types.
EXTRA_FIELDS = {
    "tenant": str,
    "ttft_slo_s": float,
    "tpot_slo_s": float,
    "target_output_tokens": int,
    "predicted_output_tokens": int,
}


def testbed_extras(request: Any) -> dict[str, Any]:
    """The per-request testbed data of a vLLM request (empty when none)."""
    extra = getattr(request.sampling_params, "extra_args", None) or {}
    given = extra.get("testbed") or {}
    unknown = set(given) - set(EXTRA_FIELDS)
    if unknown:
        raise ValueError(
            f"request {request.request_id}: unknown extra_args['testbed'] fields "
            f"{sorted(unknown)}; known: {sorted(EXTRA_FIELDS)}"
        )
    return {k: None if v is None else EXTRA_FIELDS[k](v) for k, v in given.items()}


class RequestView:
    """A vLLM request as a testbed policy reads it."""

    __slots__ = (
        "arrival_seq",
        "predicted_output_tokens",
        "priority",
        "req",
        "target_output_tokens",
        "tenant",
        "tpot_slo_s",
        "ttft_slo_s",
    )

    def __init__(self, req: Any, arrival_seq: int) -> None:
        self.req = req
        self.arrival_seq = arrival_seq
        self.priority = req.priority
        extras = testbed_extras(req)
        self.tenant = extras.get("tenant") or "default"
        self.ttft_slo_s = extras.get("ttft_slo_s")
        self.tpot_slo_s = extras.get("tpot_slo_s")
        self.target_output_tokens = extras.get("target_output_tokens")
        self.predicted_output_tokens = extras.get("predicted_output_tokens")

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def arrival_time(self) -> float:
        return self.req.arrival_time

    @property
    def sampling_params(self) -> Any:
        return self.req.sampling_params

    @property
    def prompt_token_ids(self) -> Any:
        return self.req.prompt_token_ids

    @property
    def prefix_hash_ids(self) -> None:
        return None  # vLLM requests carry their tokens

    @property
    def num_prompt_tokens(self) -> int:
        return self.req.num_prompt_tokens

    @property
    def num_computed_tokens(self) -> int:
        return self.req.num_computed_tokens

    @property
    def output_token_ids(self) -> Any:
        return self.req.output_token_ids

    @property
    def num_output_tokens(self) -> int:
        return self.req.num_output_tokens

    @property
    def num_tokens(self) -> int:
        return self.req.num_tokens

    @property
    def num_tokens_with_spec(self) -> int:
        return self.req.num_tokens_with_spec

    @property
    def spec_token_ids(self) -> Any:
        return self.req.spec_token_ids

    @property
    def num_preemptions(self) -> int:
        return self.req.num_preemptions

    @property
    def max_output_tokens(self) -> int | None:
        return self.req.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.req.is_finished()

    def __repr__(self) -> str:
        return f"RequestView({self.request_id!r}, seq={self.arrival_seq})"
