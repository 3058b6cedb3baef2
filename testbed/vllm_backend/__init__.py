"""A testbed :class:`~testbed.core.policy.Policy` inside vLLM's V1 scheduler.

``testbed.vllm_backend.scheduler.PolicyScheduler`` is the scheduler class
(vLLM's ``scheduler_cls``); it imports vLLM, so only that module may be
imported where vLLM is installed. This package and :mod:`.support` do not
import vLLM: the refusal rule and the per-request view are plain Python.
"""

from testbed.vllm_backend.support import FORGET_KEY, POLICY_KEY, check_supported, refusal

__all__ = ["FORGET_KEY", "POLICY_KEY", "check_supported", "refusal"]
