"""Which testbed policies can run inside vLLM's scheduler, and why not.

``PolicyScheduler`` places each policy hook where vLLM makes the same choice
(docs/plans/vllm_backend.md, section 1); a preemptive policy's displacement
runs before vLLM's step, as it does in the testbed's scheduler. A policy that
overrides a hook the class does not apply is refused, so that it never runs
silently without it.
"""

from __future__ import annotations

from testbed.core.policy import Policy, overrides

# The key of ``VllmConfig.additional_config`` that holds the policy spec.
POLICY_KEY = "testbed_policy"
# The key of ``additional_config`` that, true, unfinds a same-step victim's blocks.
FORGET_KEY = "testbed_forget_uncomputed"

# Hooks that PolicyScheduler does not apply, with the reason.
NOT_APPLIED = {
    "draft_cap": (
        "overrides draft_cap, which PolicyScheduler does not apply (vLLM's drafts "
        "would need its update_draft_token_ids trimmed; not built yet)"
    ),
}


def refusal(policy: Policy) -> str | None:
    """Why ``policy`` cannot run inside vLLM's scheduler, or None when it can.

    Every bundled policy can, the preemptive ones included."""
    for hook, why in NOT_APPLIED.items():
        if overrides(policy, hook):
            return f"policy {policy.name!r} ({type(policy).__name__}) {why}"
    return None


def check_supported(policy: Policy) -> None:
    """Raise ``ValueError`` with the reason when ``policy`` cannot run in vLLM."""
    why = refusal(policy)
    if why:
        raise ValueError(why)
