"""``testbed.vllm_backend`` without vLLM: it imports, accepts every bundled
policy (the preemptive ones too), refuses a policy whose hook the class does not
apply with the reason, and its request view reads as a testbed request does to
the policies that run there."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from policies import REGISTRY, make_policy
from policies.fcfs import FCFS
from testbed.core.request import Request, SamplingParams
from testbed.vllm_backend import check_supported, refusal
from testbed.vllm_backend.views import RequestView


def test_the_package_imports_without_vllm():
    code = "import sys, testbed.vllm_backend; assert 'vllm' not in sys.modules, 'vllm imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_bundled_policy_is_accepted(name):
    policy = make_policy(name)
    assert refusal(policy) is None
    check_supported(policy)


def test_a_policy_whose_draft_cap_the_class_does_not_apply_is_refused_with_the_reason():
    class FewDrafts(FCFS):
        name = "few_drafts"

        def draft_cap(self, request):
            return 1

    why = refusal(FewDrafts())
    assert why and "few_drafts" in why and "draft_cap" in why
    with pytest.raises(ValueError, match="draft_cap"):
        check_supported(FewDrafts())


def vllm_like(rid, prompt, max_tokens, arrival, priority=0, extra=None, computed=0, out=()):
    """A stand-in with the fields of vLLM's Request that the view reads."""
    params = SimpleNamespace(max_tokens=max_tokens, extra_args=extra)
    return SimpleNamespace(
        request_id=rid,
        prompt_token_ids=list(range(prompt)),
        num_prompt_tokens=prompt,
        sampling_params=params,
        arrival_time=arrival,
        priority=priority,
        num_computed_tokens=computed,
        output_token_ids=list(out),
        num_output_tokens=len(out),
        num_tokens=prompt + len(out),
    )


@pytest.mark.parametrize("name", ["fcfs", "priority", "sjf", "edf", "vtc"])
def test_a_policy_keys_a_view_as_it_keys_the_testbed_request(name):
    data = {"tenant": "t1", "ttft_slo_s": 7.5, "target_output_tokens": 30}
    ours = Request(
        "a",
        prompt_token_ids=list(range(40)),
        sampling_params=SamplingParams(max_tokens=50),
        arrival_time=3.0,
        priority=2,
        **data,
    )
    view = RequestView(vllm_like("a", 40, 50, 3.0, 2, {"testbed": data}), arrival_seq=0)
    ours.arrival_seq = 0
    policy = make_policy(name)
    if name == "vtc":
        policy.counters["t1"] = 5.0
    assert policy.key(view, 10.0) == policy.key(ours, 10.0)
    assert (view.tenant, view.ttft_slo_s, view.priority) == ("t1", 7.5, 2)


def test_the_view_keeps_the_original_priority_and_rejects_unknown_data():
    req = vllm_like("a", 8, 4, 0.0, priority=3)
    view = RequestView(req, arrival_seq=5)
    req.priority = 0  # the scheduler writes victim ranks there
    assert view.priority == 3 and view.tenant == "default" and view.arrival_seq == 5
    with pytest.raises(ValueError, match="request b: unknown extra_args"):
        RequestView(vllm_like("b", 8, 4, 0.0, extra={"testbed": {"tenat": "x"}}), 0)
