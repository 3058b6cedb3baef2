"""The simulator's fast path gives the same results as stepping one step at a time."""

from __future__ import annotations

import pytest

from tests.sim.helpers import observable, random_requests, simulate

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
