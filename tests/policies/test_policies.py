"""Each policy on a small crafted workload that shows its intended effect.

Every run uses the fake executor (a fixed 10 ms per step), so the differences
come from the policy alone; each test compares against FCFS in the same setup.
"""

from __future__ import annotations

from statistics import mean

import pytest

from policies import REGISTRY, make_policy
from policies.fcfs import FCFS
from testbed.core import Policy, Request
from testbed.core.queue import GroupedQueue
from tests.factories import create_engine, create_requests, outcomes, run, sorted_twin


def e2e(reqs: list[Request]) -> list[float]:
    return [r.finish_time - r.arrival_time for r in reqs]


def replay(policy, arrivals, **cfg):
    engine, _ = create_engine(policy, **cfg)
    run(engine, arrivals)
    return engine


def two_lengths(seed: int = 0):
    """Long jobs queued ahead of short ones, all at once, one at a time."""
    longs = create_requests(4, prompt_len=8, output_len=40, seed=seed)
    shorts = create_requests(4, prompt_len=8, output_len=4, start=4, seed=seed)
    return [(0.0, r) for r in longs + shorts]


def test_registry_names_paths_and_targets():
    assert set(REGISTRY) == {
        "fcfs",
        "priority",
        "sjf",
        "srpt",
        "cache_aware_sjf",
        "edf",
        "vtc",
        "mlfq",
    }
    assert isinstance(make_policy("policies.fcfs:FCFS"), FCFS)
    assert isinstance(make_policy({"_target_": "policies.fcfs.FCFS"}), FCFS)
    sjf = make_policy({"name": "sjf", "aging_tokens_per_s": 5.0})
    assert sjf.aging_tokens_per_s == 5.0 and not sjf.dynamic_key  # aging keeps the order
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        make_policy("nope")
    with pytest.raises(TypeError, match="not a subclass"):
        make_policy("collections:OrderedDict")
    with pytest.raises(ValueError, match="unknown victim"):
        make_policy("fcfs", victim="random")


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_policy_has_a_docstring_that_says_where_it_comes_from(name):
    policy = make_policy(name)
    module = __import__(type(policy).__module__, fromlist=["_"])
    assert isinstance(policy, Policy) and len(module.__doc__ or "") > 80


def test_fcfs_serves_in_arrival_order():
    arrivals = [(0.001 * i, r) for i, r in enumerate(create_requests(5, output_len=3))]
    replay("fcfs", arrivals, max_num_seqs=1)
    order = sorted(arrivals, key=lambda a: a[1].first_scheduled_time)
    assert [r.request_id for _, r in order] == [f"r{i}" for i in range(5)]


def test_sjf_lowers_mean_latency_against_fcfs():
    fcfs, sjf = two_lengths(), two_lengths()
    replay("fcfs", fcfs, max_num_seqs=1)
    replay("sjf", sjf, max_num_seqs=1)
    assert mean(e2e([r for _, r in sjf])) < 0.7 * mean(e2e([r for _, r in fcfs]))


def test_sjf_aging_lets_a_long_job_through_a_stream_of_short_ones():
    def workload():
        long = create_requests(1, prompt_len=4, output_len=30, start=99)[0]
        short = create_requests(60, prompt_len=4, output_len=2)
        return long, [(0.0, long)] + [(0.005 * i, r) for i, r in enumerate(short)]

    plain_long, plain = workload()
    replay("sjf", plain, max_num_seqs=1)
    aged_long, aged = workload()
    replay(make_policy("sjf", aging_tokens_per_s=200.0), aged, max_num_seqs=1)
    assert aged_long.first_scheduled_time < plain_long.first_scheduled_time


def test_priority_serves_urgent_first_and_aging_prevents_starvation():
    def workload():
        low = create_requests(1, prompt_len=4, output_len=2, start=99, priority=5)[0]
        high = create_requests(40, prompt_len=4, output_len=2, priority=0)
        return low, [(0.0, low)] + [(0.004 * i, r) for i, r in enumerate(high)]

    low, arrivals = workload()
    replay("priority", arrivals, max_num_seqs=1)
    assert low.first_scheduled_time > max(r.first_scheduled_time for _, r in arrivals[1:30])
    aged_low, aged = workload()
    replay(make_policy("priority", aging_interval_s=0.01), aged, max_num_seqs=1)
    assert aged_low.first_scheduled_time < 0.5 * low.first_scheduled_time


def test_srpt_preempts_a_long_job_for_a_short_one():
    def workload():
        long = create_requests(1, prompt_len=4, output_len=60)[0]
        short = create_requests(1, prompt_len=4, output_len=3, start=1)[0]
        return long, short, [(0.0, long), (0.1, short)]

    _, s_sjf, arrivals = workload()
    replay("sjf", arrivals, max_num_seqs=1)
    long, s_srpt, arrivals = workload()
    replay("srpt", arrivals, max_num_seqs=1)
    assert long.num_preemptions == 1
    assert e2e([s_srpt])[0] < 0.25 * e2e([s_sjf])[0]


def test_cache_aware_sjf_prefers_the_request_whose_prefix_is_cached():
    def workload():
        shared = list(range(200, 232))
        warm = create_requests(1, prompt_len=36, output_len=1, prefix=shared, start=0)[0]
        cold = create_requests(1, prompt_len=36, output_len=8, start=1, seed=1)[0]
        hot = create_requests(1, prompt_len=36, output_len=8, prefix=shared, start=2, seed=2)[0]
        blocker = create_requests(1, prompt_len=4, output_len=12, start=3)[0]
        # warm fills the cache; the blocker holds the only seat while cold
        # (earlier) and hot (cached prefix) wait.
        return cold, hot, [(0.0, warm), (0.02, blocker), (0.03, cold), (0.04, hot)]

    cold, hot, arrivals = workload()
    replay("cache_aware_sjf", arrivals, max_num_seqs=1, block_size=4)
    assert hot.first_scheduled_time < cold.first_scheduled_time
    assert hot.num_cached_tokens == 32
    cold, hot, arrivals = workload()
    replay("sjf", arrivals, max_num_seqs=1, block_size=4)  # equal sizes: arrival order
    assert cold.first_scheduled_time < hot.first_scheduled_time


def test_edf_meets_more_deadlines_than_fcfs_under_load():
    def workload():
        out = []
        for i, r in enumerate(create_requests(24, prompt_len=8, output_len=3)):
            r.ttft_slo_s = 0.5 if i % 2 == 0 else 0.06  # lax and tight SLOs, interleaved
            out.append((0.015 * i, r))  # 1.5x what one seat can serve
        return out

    def met(arrivals):
        return sum(r.first_token_time - r.arrival_time <= r.ttft_slo_s + 1e-9 for _, r in arrivals)

    fcfs, edf = workload(), workload()
    replay("fcfs", fcfs, max_num_seqs=1)
    replay("edf", edf, max_num_seqs=1)
    assert met(edf) == len(edf) and met(fcfs) <= len(fcfs) - 6


def test_edf_can_reject_requests_already_late():
    arrivals = workload = [(0.0, r) for r in create_requests(6, output_len=10, ttft_slo_s=0.05)]
    replay(make_policy("edf", reject_late=True), workload, max_num_seqs=1)
    rejected = [r for _, r in arrivals if r.reject_reason]
    assert rejected and all("deadline passed" in r.reject_reason for r in rejected)


def test_vtc_evens_out_service_between_a_heavy_and_a_light_tenant():
    def workload():
        heavy = create_requests(30, prompt_len=8, output_len=8, tenant="heavy")
        light = create_requests(10, prompt_len=8, output_len=8, start=30, tenant="light")
        # The heavy tenant floods the queue first; the light one comes a bit later.
        return [(0.0, r) for r in heavy] + [(0.05, r) for r in light]

    def light_share_early(arrivals):
        """Fraction of the first 15 admissions after the light tenant arrived."""
        later = sorted(
            (r for _, r in arrivals if r.first_scheduled_time >= 0.05),
            key=lambda r: r.first_scheduled_time,
        )[:15]
        return sum(r.tenant == "light" for r in later) / len(later)

    fcfs, vtc = workload(), workload()
    replay("fcfs", fcfs, max_num_seqs=2)
    replay("vtc", vtc, max_num_seqs=2)
    assert light_share_early(fcfs) == 0.0
    assert 0.35 <= light_share_early(vtc) <= 0.65


def test_mlfq_finishes_short_jobs_first_without_knowing_lengths():
    fcfs, mlfq = two_lengths(), two_lengths()
    replay("fcfs", fcfs, max_num_seqs=1)
    replay(make_policy("mlfq", base_quantum=4), mlfq, max_num_seqs=1)
    short_fcfs = mean(e2e([r for _, r in fcfs[4:]]))
    short_mlfq = mean(e2e([r for _, r in mlfq[4:]]))
    assert short_mlfq < 0.5 * short_fcfs
    assert mean(e2e([r for _, r in mlfq])) < mean(e2e([r for _, r in fcfs]))


def readme_policy() -> type[Policy]:
    """The policy class of the README's "Write a policy" example, as written there."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    code = text.split("```python\n# mypolicies/tenant_rr.py\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    return namespace["TenantRoundRobin"]


def test_the_readmes_policy_lets_tenants_take_turns_and_ranks_only_their_heads():
    def workload():
        flood = create_requests(12, prompt_len=8, output_len=6, tenant="a")
        others = [create_requests(3, prompt_len=8, output_len=6, start=12 + 3 * i, seed=i,
                                  tenant=t) for i, t in enumerate("bc")]  # fmt: skip
        return [(0.0, r) for r in flood] + [(0.001, r) for r in others[0] + others[1]]

    cls = readme_policy()
    policy, twin = cls(), sorted_twin(cls())
    arrivals = workload()
    engine = replay(policy, arrivals, max_num_seqs=1)
    assert isinstance(engine.scheduler.waiting, GroupedQueue)
    order = [r.tenant for _, r in sorted(arrivals, key=lambda a: a[1].first_scheduled_time)]
    # The first "a" started alone; then the three tenants take turns while all wait.
    assert order[:10] == ["a", "b", "c", "a", "b", "c", "a", "b", "c", "a"]
    assert outcomes(cls(), workload(), dict(max_num_seqs=1)) == outcomes(
        twin, workload(), dict(max_num_seqs=1)
    )
