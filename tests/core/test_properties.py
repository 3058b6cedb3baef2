"""Random workloads through the scheduler, with the invariants checked at every step.

The fake executor already checks, on every step, that each request's context
in the KV cache holds exactly its own tokens (so every prefix-cache hit returns
blocks whose contents equal the request's tokens) and that its block table
matches the manager's. Here we add the bookkeeping invariants.
"""

from __future__ import annotations

import os
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies import REGISTRY, make_policy
from testbed.core import Policy, Request, RequestStatus, SamplingParams
from tests.factories import EOS, VOCAB, create_engine, create_requests, outcomes, run, sorted_twin


def check_invariants(sched, so) -> None:
    cfg, kv = sched.config, sched.kv
    assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens)
    assert so.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(so.requests) <= cfg.max_num_seqs and len(sched.running) <= cfg.max_num_seqs
    assert len({id(r) for r in so.requests}) == len(so.requests)
    assert all(n > 0 for n in so.num_scheduled_tokens)
    # Reference counts equal the number of block tables holding each block.
    holders = Counter(b.block_id for blocks in kv.req_to_blocks.values() for b in blocks)
    for block in kv.pool.blocks:
        assert block.ref_cnt == holders.get(block.block_id, 0), block
    # The free pool holds each unreferenced block exactly once, and nothing else.
    free = [b.block_id for b in kv.pool.free_uncached] + list(kv.pool.never_used)
    free += list(kv.pool.free_cached)
    assert len(free) == len(set(free))
    assert set(free) == {b.block_id for b in kv.pool.blocks if b.ref_cnt == 0}
    assert all(b.cache_key is None for b in kv.pool.free_uncached)
    assert all(b.cache_key is not None for b in kv.pool.free_cached.values())
    # Every findable block is its key's block for lookups or one of its copies,
    # and a lookup gets the earliest registered copy.
    for key, block in kv.pool.cached.items():
        assert block.cache_key == key
    for key, copies in kv.pool.duplicates.items():
        assert len(copies) > 1 and next(iter(copies.values())) is kv.pool.cached[key]
        assert all(b.cache_key == key for b in copies.values())
    findable = [b for b in kv.pool.blocks if b.cache_key is not None]
    assert len(findable) == len(kv.pool.cached) + sum(
        len(c) - 1 for c in kv.pool.duplicates.values()
    )
    # Only live requests hold blocks, and each holds enough for its computed tokens.
    live = {r.request_id: r for r in [*sched.running, *sched.ready]} | sched.loading
    assert set(kv.req_to_blocks) <= set(live)
    for rid, r in live.items():
        assert len(kv.req_to_blocks[rid]) * kv.block_size >= r.num_computed_tokens


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    chunked = draw(st.booleans())
    budget = draw(st.integers(4, 64))
    cfg = dict(
        num_blocks=draw(st.integers(4, 48)),
        block_size=block_size,
        enable_prefix_caching=draw(st.booleans()),
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=budget,
        max_num_seqs=draw(st.integers(1, 8)),
        max_model_len=draw(st.integers(8, 96)) if chunked else budget,
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 3, 7])),
    )
    name = draw(st.sampled_from(sorted(REGISTRY)))
    victims = [None, "newest", "least_computed", "lowest_rank"]
    if make_policy(name).preemptive:  # evicts by rank only (the others livelock)
        victims = [None, "lowest_rank"]
    victim = draw(st.sampled_from(victims))
    prefixes = [
        draw(st.lists(st.integers(0, VOCAB - 2), min_size=1, max_size=24)) for _ in range(2)
    ]
    n = draw(st.integers(1, 10))
    arrivals = []
    for i in range(n):
        prefix = draw(st.sampled_from([[], *prefixes]))
        body = draw(st.lists(st.integers(0, VOCAB - 2), min_size=0, max_size=30))
        prompt = (prefix + body) or [1]
        out_len = draw(st.integers(1, 16))
        req = Request(
            request_id=f"q{i}",
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=out_len, ignore_eos=True),
            eos_token_id=EOS,
            tenant=draw(st.sampled_from(["a", "b"])),
            priority=draw(st.integers(0, 2)),
            ttft_slo_s=draw(st.sampled_from([None, 0.05, 0.5])),
        )
        if draw(st.integers(0, 9)) == 0:  # now and then a decode-side P/D request
            req.output_token_ids.append(draw(st.integers(0, VOCAB - 2)))
            req.remote_kv_tokens = len(prompt)
        arrivals.append((draw(st.integers(0, 20)) * 0.01, req))
    num_drafts = draw(st.sampled_from([0, 0, 2]))
    return cfg, make_policy(name, victim=victim), arrivals, num_drafts


# TESTBED_PROPERTY_EXAMPLES=5000 python -m tests -k properties: a deeper search.
@settings(
    max_examples=int(os.environ.get("TESTBED_PROPERTY_EXAMPLES", "300")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(workloads())
def test_random_workloads_keep_every_invariant(workload):
    cfg, policy, arrivals, num_drafts = workload
    engine, executor = create_engine(policy, num_drafts=num_drafts, **cfg)
    sched = engine.scheduler
    original_step = engine.step

    def checked_step():
        res = original_step()
        check_invariants(sched, res.scheduler_output)
        return res

    engine.step = checked_step
    total_tokens = sum(r.num_prompt_tokens + r.sampling_params.max_tokens for _, r in arrivals)
    run(engine, arrivals, max_steps=50 * total_tokens + 100)
    for _, r in arrivals:
        assert r.is_finished, r
        if r.status is RequestStatus.REJECTED:
            assert r.reject_reason
        else:
            assert r.status is RequestStatus.FINISHED_LENGTH
            assert r.num_output_tokens == r.sampling_params.max_tokens or (
                r.num_tokens >= sched.config.max_model_len
            )
    # Everything is released at the end.
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert not sched.kv.req_to_blocks and not sched.requests


def test_a_preemptive_policy_evicting_by_rank_finishes_what_newest_livelocked():
    """Found by the property test: MLFQ evicting the newest request under KV
    pressure evicted q2, which outranked q1; q2 then displaced q1, both came
    back, and so on forever. Evicting by rank, the same workload finishes, and
    the contradicting victim is refused."""
    import pytest

    cfg = dict(
        num_blocks=20, block_size=1, enable_prefix_caching=False, enable_chunked_prefill=True,
        max_num_batched_tokens=5, max_num_seqs=2, max_model_len=20, long_prefill_token_threshold=3,
    )  # fmt: skip
    with pytest.raises(ValueError, match="evicts by rank only"):
        make_policy("mlfq", victim="newest")
    from testbed.core import Policy

    class Displacing(Policy):  # a new preemptive policy needs no victim of its own
        preemptive = True

    assert Displacing().victim == "lowest_rank" and make_policy("srpt").victim == "lowest_rank"

    def request(i: int, prompt: list[int], out: int) -> Request:
        params = SamplingParams(max_tokens=out, ignore_eos=True)
        return Request(f"q{i}", prompt, sampling_params=params, eos_token_id=EOS)

    arrivals = [(0.0, request(1, [0] * 7 + [6, 0, 0], 10)), (0.0, request(2, [0] * 14, 1))]
    engine, _ = create_engine(make_policy("mlfq"), **cfg)
    run(engine, arrivals, max_steps=2000)
    assert all(r.status is RequestStatus.FINISHED_LENGTH for _, r in arrivals)


@st.composite
def grouped_policies(draw) -> Policy:
    """VTC (groups: tenants) or MLFQ (groups: levels, regrouped by starvation),
    with quanta and starvation times that the short workloads reach."""
    if draw(st.booleans()):
        victim = draw(st.sampled_from([None, "newest", "least_computed", "lowest_rank"]))
        return make_policy("vtc", victim=victim)
    return make_policy(
        "mlfq",
        base_quantum=draw(st.sampled_from([1.0, 2.0, 8.0])),
        prefill_tokens_per_unit=draw(st.sampled_from([4.0, 256.0])),
        starvation_s=draw(st.sampled_from([0.02, 0.05, 30.0])),
    )


@settings(
    max_examples=int(os.environ.get("TESTBED_PROPERTY_EXAMPLES", "300")) // 2,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(workloads(), grouped_policies())
def test_a_grouped_queue_serves_exactly_as_the_sorted_one(workload, policy):
    """The grouped queue ranks only each group's head, moving requests between
    groups at the policy's regroup times; with the groups off the queue sorts
    everything every step. The same schedule."""
    cfg, _, arrivals, num_drafts = workload
    twin = sorted_twin(policy)  # before the run: a policy keeps state
    assert outcomes(policy, arrivals, cfg, num_drafts) == outcomes(twin, arrivals, cfg, num_drafts)


def test_a_grouped_queue_under_load_with_many_tenants_and_preemptions():
    """Five tenants flooding a small cache (preemptions put requests back in the
    queue out of arrival order) and trickling in: the same schedule both ways."""
    arrivals = []
    for i in range(5):
        reqs = create_requests(40, prompt_len=12 + 3 * i, output_len=6 + 2 * i, start=40 * i,
                               seed=i, tenant=f"t{i}")  # fmt: skip
        arrivals += [(0.013 * j * (i + 1), r) for j, r in enumerate(reqs)]
    cfg = dict(num_blocks=40, block_size=4, max_num_seqs=6, max_num_batched_tokens=32)
    vtc = make_policy("vtc")
    twin = sorted_twin(vtc)
    grouped = outcomes(vtc, arrivals, cfg)
    assert sum(o[4] for o in grouped) > 0  # the load did preempt
    assert grouped == outcomes(twin, arrivals, cfg)
