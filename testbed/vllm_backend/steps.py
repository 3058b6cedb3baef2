"""What ``PolicyScheduler`` records of each vLLM step, and its ``steps.csv`` row.

vLLM's engine returns only request outputs from a step; the scheduler class sees
the step's schedule, so it records the composition (each request's new tokens
and context), the preemptions, the KV usage and the queue lengths, with the
times at which scheduling and the output update began and ended. Nothing here
imports vLLM: the record is plain data that crosses into the parent process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from testbed.core.outputs import pass_features

# The key of ``VllmConfig.additional_config`` that, true, turns the record on.
STEP_LOG_KEY = "testbed_step_log"


@dataclass(slots=True)
class VllmStep:
    """One vLLM engine step as the scheduler saw it (times on the policy's clock)."""

    schedule_start: float
    schedule_end: float
    update_start: float = 0.0
    update_end: float = 0.0
    request_ids: list[str] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # new tokens per request
    contexts: list[int] = field(default_factory=list)  # tokens in its KV before the step
    decode: list[bool] = field(default_factory=list)  # only its last token (testbed's rule)
    new_ids: list[str] = field(default_factory=list)  # first scheduled, or resumed
    preempted_ids: list[str] = field(default_factory=list)
    kv_usage: float = 0.0  # what the step holds, before finished requests free
    num_waiting: int = 0  # after the step
    num_running: int = 0

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for n, d in zip(self.num_tokens, self.decode) if not d)

    @property
    def num_decode_tokens(self) -> int:
        return sum(n for n, d in zip(self.num_tokens, self.decode) if d)

    def features(self) -> tuple[int, int, float, int, int]:
        """``(num_reqs, num_tokens, attn_pairs, kv_tokens, max_kv)``, as
        ``testbed.core.SchedulerOutput.features`` counts them."""
        return pass_features(zip(self.contexts, self.num_tokens))


def is_decode(context: int, num_tokens_before: int) -> bool:
    """A request computes only its last token (plus drafts): the testbed's rule for
    a decode token, ``context >= prompt + output - 1`` before the step."""
    return context >= num_tokens_before - 1


def merged(records: list[VllmStep], start: float) -> VllmStep:
    """One record of the scheduler's records of an engine step (one in synchronous
    scheduling; none when vLLM had nothing to schedule)."""
    if len(records) == 1:
        return records[0]
    out = VllmStep(schedule_start=start, schedule_end=start)
    for r in records:
        for name in ("request_ids", "num_tokens", "contexts", "decode", "new_ids"):
            getattr(out, name).extend(getattr(r, name))
        out.preempted_ids.extend(r.preempted_ids)
        out.kv_usage = r.kv_usage
        out.num_waiting, out.num_running = r.num_waiting, r.num_running
    return out
