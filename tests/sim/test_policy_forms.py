"""Policies whose schedule has two forms, the cheap one the queue uses and the plain one.

A policy that groups its waiting queue (``Policy.group_of``) against the same policy
sorting every waiting request every step; aging as a static key against the textbook
form re-ranked every step. Same simulated schedule each time.
"""

from __future__ import annotations

import warnings

import pytest

from policies import make_policy
from policies.priority import Priority
from policies.sjf import SJF
from testbed.core import Policy
from testbed.core.policy import PolicyCostWarning, warn_of_costs
from testbed.core.queue import GroupedQueue
from tests.factories import sorted_twin
from tests.sim.helpers import observable, random_requests, simulate


@pytest.mark.parametrize("policy", ["vtc", "mlfq", "cache_aware_sjf"])
@pytest.mark.parametrize("num_blocks", [20_000, 700], ids=["roomy", "tight"])
def test_a_grouped_waiting_queue_simulates_as_the_sorted_one(policy, num_blocks):
    """A policy that groups its queue (tenants, levels, or the requests that cannot
    hit the prefix cache) against the same policy sorting the queue every step."""
    kwargs = {"starvation_s": 2.0} if policy == "mlfq" else {}  # starving within the run
    grouped = make_policy(policy, **kwargs)
    twin = sorted_twin(grouped)
    run = dict(fast_forward=True, num_blocks=num_blocks, max_num_seqs=8)
    a, engines = simulate(random_requests(250, rate=8.0), grouped, **run)
    b, _ = simulate(random_requests(250, rate=8.0), twin, **run)
    assert isinstance(engines[0].scheduler.waiting, GroupedQueue)
    assert observable(a.requests) == observable(b.requests)
    assert a.steps.to_frame().equals(b.steps.to_frame())
    assert max(a.steps.to_frame()["num_waiting"]) > 20  # the queue was long


@pytest.mark.parametrize("num_blocks", [20_000, 700], ids=["roomy", "tight"])
@pytest.mark.parametrize("name", ["sjf", "priority"])
def test_aging_as_a_static_key_ranks_as_aging_every_step(name, num_blocks):
    """SJF and priority rank with aging by a key that does not change while requests
    wait (size + aging x arrival); the textbook form, size - aging x time waited,
    re-ranked every step, gives the same schedule."""

    class AgingSJF(SJF):  # the textbook form
        dynamic_key = True

        def key(self, request, now):
            return self.job_size(request) - self.aging_tokens_per_s * (now - request.arrival_time)

    class AgingPriority(Priority):
        dynamic_key = True

        def key(self, request, now):
            prio = request.priority - (now - request.arrival_time) / self.aging_interval_s
            return (prio, request.arrival_time)

    static, textbook = (
        (SJF(aging_tokens_per_s=20.0), AgingSJF(aging_tokens_per_s=20.0))
        if name == "sjf"
        else (Priority(aging_interval_s=0.5), AgingPriority(aging_interval_s=0.5))
    )
    assert not static.dynamic_key
    run = dict(fast_forward=True, num_blocks=num_blocks, max_num_seqs=8)
    a, _ = simulate(random_requests(250, rate=8.0), static, **run)
    b, _ = simulate(random_requests(250, rate=8.0), textbook, **run)
    assert observable(a.requests) == observable(b.requests)
    # Aging mattered: some request ran before one that was ahead of it without aging.
    c, _ = simulate(random_requests(250, rate=8.0), name, **run)
    assert observable(a.requests) != observable(c.requests)


class LateCounter(Policy):
    """Counts steps in on_step without on_decode_steps: the fast path is off."""

    name = "late_counter"

    def on_step(self, output, finished, now) -> None:
        pass


def test_a_simulation_names_what_a_policys_hooks_cost_it_once():
    with pytest.warns(PolicyCostWarning, match="on_decode_steps") as caught:
        simulate(random_requests(5), LateCounter())
        simulate(random_requests(5), LateCounter())  # the same class again: said once
    assert len(caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_of_costs(LateCounter())  # already said
