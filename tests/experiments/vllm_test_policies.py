"""Policies that exercise the hooks no bundled policy overrides (token caps,
deferral, rejection with a reason), for the parity tests of
``testbed.vllm_backend``; importable by path in the replay venv too."""

from __future__ import annotations

from policies.fcfs import FCFS
from policies.sjf import SJF
from testbed.core.policy import ADMIT, Admission, Decision


class CappedFCFS(FCFS):
    """FCFS whose long prompts compute at most 48 tokens a step."""

    name = "capped_fcfs"

    def token_cap(self, request) -> int | None:
        return 48 if request.num_prompt_tokens > 200 else None


class DeferringSJF(SJF):
    """SJF that defers long prompts while the cache is over half full and rejects
    the longest outright."""

    name = "deferring_sjf"

    def admit(self, request, now: float) -> Admission:
        if request.num_prompt_tokens > 380:
            return Admission(Decision.REJECT, f"prompt of {request.num_prompt_tokens} tokens")
        if request.num_prompt_tokens > 250 and self.view.kv_usage > 0.5:
            return Admission(Decision.DEFER)
        return ADMIT


class FirstRunningVictim(FCFS):
    """FCFS that preempts the running request served first (a custom selector that
    reads the candidates' order)."""

    name = "first_running_victim"

    def select_victim(self, candidates, now: float):
        return candidates[0]
