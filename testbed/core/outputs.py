"""What crosses the line between the control plane and a data plane.

The scheduler emits a :class:`SchedulerOutput` per step; an executor (simulated
or real) runs it and answers with an :class:`ExecutorOutput`. Both are plain
containers so that a simulator, a real model runner and a test's fake executor
read and write them the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from testbed.core.request import Request


@dataclass(slots=True)
class SchedulerOutput:
    """One step's schedule: a number of new tokens for each scheduled request.

    ``requests[i]`` computes ``num_scheduled_tokens[i]`` tokens starting at
    position ``context_len(i)`` (its computed count before the step); its
    ``num_computed_tokens`` already counts them (and after the step, less any
    rejected drafts). Requests in ``new_req_ids`` are scheduled for the first time or again
    after a preemption: the executor builds their state (block table, sampler)
    from scratch. ``new_block_ids`` lists blocks appended to a request's block
    table in this step. Drafts to verify are in ``spec_token_ids``; a request
    samples after the step exactly when its computed count has caught up with
    all its tokens (prompt, output and scheduled drafts).
    """

    step_id: int
    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)  # computed tokens before the step
    total_num_scheduled_tokens: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    new_req_ids: set[str] = field(default_factory=set)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    preempted_req_ids: list[str] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)  # since the last step
    # Disaggregated prefill/decode: requests whose first ``remote_kv_tokens``
    # tokens a KV connector should write into these blocks.
    kv_loads: list[tuple[Request, list[int]]] = field(default_factory=list)
    # What the scheduler's KV connector tells the data side to do in this step.
    kv_connector_metadata: Any = None
    _features: tuple[int, int, float, int, int] | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.requests)

    @property
    def is_empty(self) -> bool:
        return not self.requests and not self.kv_loads

    def context_len(self, i: int) -> int:
        """Tokens already in the KV cache for ``requests[i]`` before this step."""
        return self.context_lens[i]

    def features(self) -> tuple[int, int, float, int, int]:
        """``(num_reqs, num_tokens, attn_pairs, kv_tokens, max_kv)``: what a latency
        model predicts a step from. ``attn_pairs`` counts (query, key) pairs of causal
        attention; ``kv_tokens`` the K/V entries read (context plus new tokens);
        ``max_kv`` the most any one request reads (unequal contexts cost more).
        Computed once per step (a simulator's executor and the step log share it)."""
        if self._features is None:
            pairs, kv, longest = 0.0, 0, 0
            for req, n in zip(self.requests, self.num_scheduled_tokens, strict=True):
                end = req.num_computed_tokens  # context + new tokens
                pairs += n * (end - n + (n + 1) / 2)
                kv += end
                if end > longest:
                    longest = end
            tokens = self.total_num_scheduled_tokens
            self._features = (len(self.requests), tokens, pairs, kv, longest)
        return self._features

    def samples(self, i: int) -> bool:
        """Whether ``requests[i]`` samples a token at the end of this step."""
        req = self.requests[i]
        return req.num_computed_tokens >= req.num_tokens_with_spec


def pass_features(rows) -> tuple[int, int, float, int, int]:
    """:meth:`SchedulerOutput.features` of a forward pass over ``rows`` of
    ``(context, new tokens)`` (a draft model's passes, which no schedule describes)."""
    reqs = tokens = kv = longest = 0
    pairs = 0.0
    for ctx, n in rows:
        reqs += 1
        tokens += n
        pairs += n * (ctx + (n + 1) / 2)
        kv += ctx + n
        if ctx + n > longest:
            longest = ctx + n
    return reqs, tokens, pairs, kv, longest


@dataclass(slots=True)
class ExecutorOutput:
    """What a data plane reports back after running a step.

    ``sampled_token_ids[i]`` belongs to ``requests[i]`` of the schedule: empty
    for a request that did not sample (a prefill chunk), one token for a plain
    decode, accepted drafts plus one for speculative decoding. ``None`` means
    the data plane has no real tokens (simulation): each request that samples
    gets one stand-in token. ``latency_s`` is the step's duration on a simulated
    clock; a data plane on the wall clock leaves it ``None`` and reports what it
    measured in ``measured_s``.
    """

    sampled_token_ids: list[list[int]] | None = None
    latency_s: float | None = None
    measured_s: float | None = None
    draft_token_ids: dict[str, list[int]] | None = None  # next step's drafts
    finished_recving: set[str] | None = None  # requests whose remote KV arrived
    finished_sending: set[str] | None = None  # finished requests whose KV was sent
    failed_recving: set[str] | None = None  # requests whose KV never came: recompute
    # Simulated speculative decoding: accepted drafts per request, when no real
    # tokens exist (``sampled_token_ids`` is None).
    num_accepted_drafts: dict[str, int] | None = None


class Executor(Protocol):
    """A data plane: runs one scheduled step.

    Implementations: ``testbed.sim.SimExecutor`` (predicts the latency),
    ``testbed.engine.ModelExecutor`` (runs a real model), and the fake executors
    in the tests.
    """

    def execute(self, scheduler_output: SchedulerOutput) -> ExecutorOutput:
        """Run ``scheduler_output`` and report sampled tokens (and timing)."""
        ...
