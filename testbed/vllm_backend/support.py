"""Which testbed policies can run inside vLLM's scheduler, and why not.

vLLM keeps a step's schedule in locals of ``Scheduler.schedule``; a hook that
must act between its running loop and its waiting loop has no place there
(see docs/plans/vllm_backend.md, section 2).
"""

from __future__ import annotations

from testbed.core.policy import Policy

# The key of ``VllmConfig.additional_config`` that holds the policy spec.
POLICY_KEY = "testbed_policy"
# The key of ``additional_config`` that, true, unfinds a same-step victim's blocks.
FORGET_KEY = "testbed_forget_uncomputed"

PREEMPTIVE = (
    "is preemptive: its waiting requests displace running ones between vLLM's "
    "running loop and its waiting loop, where vLLM keeps the step's schedule in "
    "locals of Scheduler.schedule (an evicted request would stay in the step's "
    "output); refused until displacement moves to the start of the step"
)


def refusal(policy: Policy) -> str | None:
    """Why ``policy`` cannot run inside vLLM's scheduler, or None when it can."""
    if policy.preemptive:
        return f"policy {policy.name!r} ({type(policy).__name__}) {PREEMPTIVE}"
    return None


def check_supported(policy: Policy) -> None:
    """Raise ``ValueError`` with the reason when ``policy`` cannot run in vLLM."""
    why = refusal(policy)
    if why:
        raise ValueError(why)
