"""The policy API's seams: the queue a policy gets, what on_step sees, the
warnings of what a hook costs, and the public grouping check."""

from __future__ import annotations

import itertools
import warnings

import pytest

from policies import make_policy
from policies.vtc import VTC
from testbed.core import Policy
from testbed.core.policy import costs_of, overrides
from testbed.core.policy_check import check_grouping, outcomes, stand_in_engine, workload
from testbed.core.queue import GroupedQueue, ResortedQueue, SortedQueue, create_waiting_queue
from tests.factories import create_engine, create_requests, run


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("fcfs", SortedQueue),
        ("sjf", SortedQueue),
        ("edf", SortedQueue),
        ("srpt", SortedQueue),  # its waiting requests keep their key; it reorders the running
        ("vtc", GroupedQueue),
        ("mlfq", GroupedQueue),
        ("cache_aware_sjf", GroupedQueue),
    ],
)
def test_each_policy_gets_the_queue_of_its_kind_of_key(name, kind):
    assert type(create_waiting_queue(make_policy(name))) is kind


class Recorder(Policy):
    """Records what on_step sees of each scheduled request."""

    name = "recorder"

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, int, int, int]] = []

    def on_step(self, output, finished, now) -> None:
        for i, req in enumerate(output.requests):
            n = output.num_scheduled_tokens[i]
            self.seen.append((req.request_id, output.context_len(i), n, req.num_computed_tokens))

    def on_decode_steps(self, requests, num_steps, finished, now) -> None:
        pass


def test_on_step_sees_the_count_before_the_step_even_when_drafts_are_rejected():
    # With drafts (a third of them wrong), a request's computed count after the
    # step is rolled back; context_len is still the count the step started from.
    policy = Recorder()
    engine, executor = create_engine(policy, num_drafts=3)
    executor.draft_accuracy = 0.6
    requests = create_requests(4, prompt_len=12, output_len=20)
    run(engine, [(0.0, r) for r in requests])
    by_request: dict[str, list[tuple[int, int, int]]] = {}
    for rid, ctx, n, after in policy.seen:
        by_request.setdefault(rid, []).append((ctx, n, after))
    rolled_back = 0
    for steps in by_request.values():
        assert steps[0][0] == 0  # the first step starts from nothing
        for (ctx, n, after), (next_ctx, _, _) in itertools.pairwise(steps):
            assert after <= ctx + n
            assert next_ctx == after  # the next step starts where this one ended up
            rolled_back += after < ctx + n
    assert rolled_back > 0  # drafts were rejected, so the check above meant something


class OnStepOnly(Policy):
    name = "on_step_only"

    def on_step(self, output, finished, now) -> None:
        pass


class Admits(Policy):
    name = "admits"

    def admit(self, request, now):
        return super().admit(request, now)


def test_the_hooks_that_cost_the_fast_path_are_named():
    assert costs_of(OnStepOnly()) == ["on_step"]
    assert costs_of(Admits()) == ["admit"]
    assert costs_of(make_policy("vtc")) == []  # on_step with on_decode_steps
    assert costs_of(make_policy("mlfq")) == []
    with warnings.catch_warnings():  # a bare scheduler (the real engine's) says nothing
        warnings.simplefilter("error")
        create_engine(OnStepOnly())


def test_edf_keeps_the_fast_path_unless_it_rejects_late_requests():
    assert not overrides(make_policy("edf"), "admit")
    late = make_policy("edf", reject_late=True)
    assert overrides(late, "admit") and costs_of(late) == ["admit"]


def test_the_grouping_checks_default_run_queues_and_preempts():
    seen, most_waiting = outcomes(stand_in_engine(VTC()), workload(), 100_000)
    assert most_waiting > 50
    assert sum(s[4] for s in seen) > 10  # preemptions: requeued requests are checked too


def test_the_grouping_check_passes_the_bundled_grouped_policies():
    check_grouping(VTC)
    check_grouping(lambda: make_policy("mlfq", starvation_s=2.0))  # starving within the run
    check_grouping(lambda: make_policy("cache_aware_sjf"))


class WrongOrderVTC(VTC):
    """Groups by tenant but orders each group newest first, while the key says oldest."""

    name = "wrong_vtc"

    def order_in_group(self, request):
        return -request.arrival_time


def test_the_grouping_check_names_a_request_where_grouping_breaks_the_ranking():
    with pytest.raises(AssertionError, match=r"request r\d+: .*order_in_group"):
        check_grouping(WrongOrderVTC)
    with pytest.raises(AssertionError, match="does not group"):
        check_grouping(lambda: make_policy("fcfs"))


class Dynamic(Policy):
    """A dynamic key without groups: shortest prompt first, re-ranked every read."""

    name = "dynamic"
    dynamic_key = True

    def key(self, request, now):
        return request.num_prompt_tokens


def test_a_dynamic_key_without_groups_gets_the_queue_that_sorts_when_read():
    assert type(create_waiting_queue(Dynamic())) is ResortedQueue


def test_the_grouping_check_refuses_a_workload_that_keeps_no_queue():
    # One request at a time: nothing waits, so grouping could not have mattered.
    sparse = [(10.0 * i, r) for i, (_, r) in enumerate(workload(num_requests=5))]
    with pytest.raises(AssertionError, match="never more than one request waiting"):
        check_grouping(VTC, sparse)
