"""The simulator's fast path gives the same results as stepping one step at a time."""

from __future__ import annotations

import pytest

from tests.sim.helpers import random_requests, simulate

POLICIES = [
    "fcfs",
    "sjf",
    "srpt",
    "edf",
    "vtc",
    "mlfq",
    "cache_aware_sjf",
    {"name": "priority", "aging_interval_s": 0.5},
    {"name": "fcfs", "victim": "least_computed"},
]


def observable(requests):
    return [
        (
            r.request_id,
            r.status,
            r.first_scheduled_time,
            r.first_token_time,
            r.finish_time,
            tuple(r.token_times),
            r.num_preemptions,
            r.num_cached_tokens,
            r.num_output_tokens,
        )
        for r in requests
    ]


@pytest.mark.parametrize("policy", POLICIES, ids=str)
@pytest.mark.parametrize("num_blocks", [20_000, 700], ids=["roomy", "tight"])
def test_fast_path_equals_stepping(policy, num_blocks):
    fast, _ = simulate(random_requests(250), policy, True, num_blocks)
    slow, _ = simulate(random_requests(250), policy, False, num_blocks)
    assert observable(fast.requests) == observable(slow.requests)
    assert fast.steps.to_frame().equals(slow.steps.to_frame())
    assert fast.duration_s == slow.duration_s
    if policy == "fcfs":
        assert fast.num_jumped_steps > len(fast.steps) // 2  # the fast path did the work
    if num_blocks == 700 and policy == "fcfs":
        assert sum(r.num_preemptions for r in fast.requests) > 0  # pressure was real


def test_fast_path_equals_stepping_with_replicas_and_a_router():
    fast, _ = simulate(random_requests(300, rate=12), "fcfs", True, 2000, replicas=3)
    slow, _ = simulate(random_requests(300, rate=12), "fcfs", False, 2000, replicas=3)
    assert observable(fast.requests) == observable(slow.requests)
    assert fast.steps.to_frame().equals(slow.steps.to_frame())


@pytest.mark.parametrize("fast_forward", [True, False])
def test_every_request_is_reported_finished_exactly_once(fast_forward):
    requests = random_requests(300, rate=12)
    result, _ = simulate(requests, "fcfs", fast_forward, 20_000, replicas=2)
    assert all(r.is_finished for r in result.requests)
    assert result.extra["num_finished_reported"] == len(requests)
    assert result.extra["outstanding"] == [0, 0]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_fast_path_equals_stepping_when_a_prefill_makes_room_through_the_prefix_cache(seed):
    # Under a tight cache the head of the queue finds no room and the fast path
    # may jump; but a prefill that just ran registers blocks the head shares (the
    # workload's common system prompts), so at the next step it needs fewer
    # blocks and stepping admits it. Seed 1 jumped past that admission before.
    fast, _ = simulate(random_requests(250, seed=seed), "fcfs", True, 700)
    slow, _ = simulate(random_requests(250, seed=seed), "fcfs", False, 700)
    assert observable(fast.requests) == observable(slow.requests)
    assert fast.steps.to_frame().equals(slow.steps.to_frame())
    assert fast.num_jumped_steps > 0


@pytest.mark.parametrize("policy", ["vtc", "mlfq", "cache_aware_sjf"])
@pytest.mark.parametrize("num_blocks", [20_000, 700], ids=["roomy", "tight"])
def test_a_grouped_waiting_queue_simulates_as_the_sorted_one(policy, num_blocks):
    """A policy that groups its queue (tenants, levels, or the requests that cannot
    hit the prefix cache) against the same policy sorting the queue every step."""
    from policies import make_policy
    from tests.core.test_properties import sorted_twin

    kwargs = {"starvation_s": 2.0} if policy == "mlfq" else {}  # starving within the run
    grouped = make_policy(policy, **kwargs)
    twin = sorted_twin(grouped)
    run = dict(fast_forward=True, num_blocks=num_blocks, max_num_seqs=8)
    a, engines = simulate(random_requests(250, rate=8.0), grouped, **run)
    b, _ = simulate(random_requests(250, rate=8.0), twin, **run)
    assert engines[0].scheduler.waiting.grouped
    assert observable(a.requests) == observable(b.requests)
    assert a.steps.to_frame().equals(b.steps.to_frame())
    assert max(a.steps.to_frame()["num_waiting"]) > 20  # the queue was long


@pytest.mark.parametrize("num_blocks", [20_000, 700], ids=["roomy", "tight"])
@pytest.mark.parametrize("name", ["sjf", "priority"])
def test_aging_as_a_static_key_ranks_as_aging_every_step(name, num_blocks):
    """SJF and priority rank with aging by a key that does not change while requests
    wait (size + aging x arrival); the textbook form, size - aging x time waited,
    re-ranked every step, gives the same schedule."""
    from policies.priority import Priority
    from policies.sjf import SJF

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
