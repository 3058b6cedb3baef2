"""Every scheduling decision, through small factories and a fake executor."""

from __future__ import annotations

import pytest

from policies.fcfs import FCFS
from testbed.core import ExecutorOutput, Request, RequestStatus, SamplingParams
from tests.factories import EOS, create_engine, create_requests, create_scheduler, run


def step(sched, now: float = 0.0, tokens=None):
    """Schedule, then feed back one token per sampling request (or ``tokens``)."""
    so = sched.schedule(now)
    sampled = [([7] if so.samples(i) else []) for i in range(so.num_reqs)]
    if tokens is not None:
        sampled = [tokens.get(r.request_id, s) for r, s in zip(so.requests, sampled)]
    finished = sched.update_from_output(so, ExecutorOutput(sampled_token_ids=sampled), now)
    return so, finished


def scheduled(so) -> dict[str, int]:
    return {r.request_id: n for r, n in zip(so.requests, so.num_scheduled_tokens)}


def test_running_first_then_waiting_within_the_token_budget():
    s = create_scheduler(max_num_batched_tokens=20, num_blocks=64)
    a, b, c = create_requests(3, prompt_len=12, output_len=8)
    s.add_request(a, 0)
    so, _ = step(s)
    assert scheduled(so) == {"r0": 12}
    s.add_request(b, 0)
    s.add_request(c, 0)
    so, _ = step(s)
    # a decodes one token first; b gets a full prompt; c the budget left (chunk).
    assert scheduled(so) == {"r0": 1, "r1": 12, "r2": 7}
    assert so.num_decode_tokens == 1 and so.num_prefill_tokens == 19
    so, _ = step(s)
    assert scheduled(so) == {"r0": 1, "r1": 1, "r2": 5}


def test_max_num_seqs_limits_the_batch():
    s = create_scheduler(max_num_seqs=2)
    for r in create_requests(3, prompt_len=4):
        s.add_request(r, 0)
    so, _ = step(s)
    assert len(so.requests) == 2 and s.num_waiting == 1


def test_long_prefill_threshold_caps_chunks():
    s = create_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=5)
    a, b = create_requests(2, prompt_len=12)
    s.add_request(a, 0)
    s.add_request(b, 0)
    so, _ = step(s)
    assert scheduled(so) == {"r0": 5, "r1": 5}


def test_without_chunked_prefill_prompts_go_whole_or_wait():
    s = create_scheduler(
        enable_chunked_prefill=False, max_num_batched_tokens=256, max_model_len=256, num_blocks=256
    )
    a, b = create_requests(2, prompt_len=150)
    s.add_request(a, 0)
    s.add_request(b, 0)
    so, _ = step(s)
    assert scheduled(so) == {"r0": 150}  # b does not fit the rest of the budget
    so, _ = step(s)
    assert scheduled(so) == {"r0": 1, "r1": 150}


def test_without_chunked_prefill_a_prompt_too_long_for_the_budget_left_holds_the_queue():
    """As vLLM: no later, shorter request is admitted past it."""
    s = create_scheduler(
        enable_chunked_prefill=False, max_num_batched_tokens=256, max_model_len=256, num_blocks=256
    )
    a, b = create_requests(2, prompt_len=150)
    c = create_requests(1, prompt_len=20, start=2)[0]
    for r in (a, b, c):
        s.add_request(r, 0)
    so, _ = step(s)
    assert scheduled(so) == {"r0": 150}  # c would fit the 106 tokens left, but b is first


def test_long_prefill_threshold_applies_only_with_others_to_serve():
    """As vLLM: the cap keeps a long prompt from starving the others; alone, a
    request uses the whole budget."""
    s = create_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=5)
    a, b = create_requests(2, prompt_len=40)
    s.add_request(a, 0)
    so, _ = step(s)
    assert scheduled(so) == {"r0": 40}
    s.add_request(b, 0)
    so, _ = step(s)
    assert scheduled(so) == {"r0": 1, "r1": 5}


@pytest.mark.parametrize("reserve", [True, False])
def test_reserve_full_isl_admits_only_a_prompt_whose_every_block_is_free(reserve):
    """vLLM 0.34's scheduler_reserve_full_isl: the whole prompt must fit in free
    blocks at admission; off, its first chunk suffices."""
    s = create_scheduler(
        num_blocks=16, block_size=4, max_num_batched_tokens=12, reserve_full_isl=reserve
    )
    a = create_requests(1, prompt_len=16, output_len=8)[0]
    b = create_requests(1, prompt_len=52, output_len=4, start=1, seed=1)[0]
    s.add_request(a, 0)
    step(s)  # a: its first chunk, 3 blocks
    s.add_request(b, 0)
    so, _ = step(s)  # a: the rest, 1 block; 12 free, b's first chunk needs 2, its prompt 13
    assert ("r1" in scheduled(so)) is (not reserve)
    assert s.admission_blocked_on_kv is reserve


def test_a_victim_scheduled_earlier_in_its_step_takes_back_the_blocks_registered_for_it():
    """The priority policy may preempt a request it scheduled earlier in the same
    step: that step never runs for the victim, so blocks registered for it
    (findable from their allocation) must not be hit. (vLLM's priority policy
    leaves them findable, holding KV that was never written.)"""
    s = create_scheduler(
        "priority",
        num_blocks=8,
        block_size=4,
        max_num_batched_tokens=12,
        long_prefill_token_threshold=6,
        reserve_full_isl=False,
    )
    low = create_requests(1, prompt_len=30, output_len=2, priority=1)[0]
    high = create_requests(1, prompt_len=24, output_len=2, start=1, seed=1, priority=0)[0]
    s.add_request(low, 0)
    step(s)  # low alone: tokens 0-11 (blocks 0-2)
    s.add_request(high, 0)
    step(s)  # low: 12-17 (block 3 full, block 4 partial); high: 0-5
    so, _ = step(s)  # low: 18-23 (blocks 4, 5) takes the last free block; high needs one
    assert so.preempted_req_ids == ["r0"] and scheduled(so) == {"r1": 6}
    probe = Request("p", prompt_token_ids=list(low.prompt_token_ids[:20]) + [1])
    assert s.kv.get_computed_blocks(probe)[1] == 16  # block 4 was never completed


def test_chunked_prefill_off_needs_a_budget_that_holds_max_model_len():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        create_scheduler(enable_chunked_prefill=False, max_num_batched_tokens=64)


def test_preemption_frees_the_newest_and_blocks_admission_that_step():
    # 6 blocks of 4 tokens; three requests of 8 prompt tokens fill them.
    s = create_scheduler(num_blocks=6, block_size=4, enable_prefix_caching=False)
    reqs = create_requests(4, prompt_len=8, output_len=10)
    for r in reqs[:3]:
        s.add_request(r, 0)
    step(s)
    s.add_request(reqs[3], 0)
    so, _ = step(s)  # r0 needs a 3rd block: none free, so the newest (r2) goes
    assert so.preempted_req_ids == ["r2"]
    assert "r3" not in scheduled(so)  # no admission in a step that preempted
    r2 = reqs[2]
    assert r2.status is RequestStatus.PREEMPTED and r2.num_computed_tokens == 0
    assert r2.num_preemptions == 1 and s.kv.get_block_ids("r2") == []
    assert scheduled(so) == {"r0": 1, "r1": 1}


def test_a_preemptive_policy_displaces_at_the_start_of_the_step_on_its_state():
    """SRPT: a waiting request with less work left displaces the running one with
    the most, judged on the batch and free blocks before the step allocates (as
    vLLM's PolicyScheduler can): the victim gets nothing and no one is admitted."""
    s = create_scheduler("srpt", num_blocks=8, block_size=4, enable_prefix_caching=False)
    (long,) = create_requests(1, prompt_len=8, output_len=20, target_output_tokens=100)
    (short,) = create_requests(1, prompt_len=24, output_len=1, start=1)
    s.add_request(long, 0)
    step(s)  # long: 2 blocks; 6 free
    s.add_request(short, 0)  # 25 tokens of work left against 99; needs 6 blocks
    so, _ = step(s)  # 6 free before the step: no displacement; long's decode takes one
    assert scheduled(so) == {"r0": 1} and not so.preempted_req_ids
    assert short.status is RequestStatus.WAITING  # 5 left: no room
    so, _ = step(s)  # 5 free before the step: long is displaced
    assert so.preempted_req_ids == ["r0"] and scheduled(so) == {}
    assert long.status is RequestStatus.PREEMPTED and long.num_computed_tokens == 0
    so, _ = step(s)
    assert scheduled(so) == {"r1": 24}


def test_a_displacement_in_a_full_batch_leaves_its_slot_empty_for_the_step():
    s = create_scheduler("srpt", max_num_seqs=2)
    a, b = create_requests(2, prompt_len=4, output_len=30)
    (c,) = create_requests(1, prompt_len=4, output_len=5, start=2)
    a.target_output_tokens = 10  # less work than b
    for r in (a, b):
        s.add_request(r, 0)
    step(s)
    s.add_request(c, 0)
    so, _ = step(s)  # the batch is full: c displaces b, which the step skips
    assert so.preempted_req_ids == ["r1"] and scheduled(so) == {"r0": 1}
    so, _ = step(s)
    assert scheduled(so) == {"r0": 1, "r2": 4}


def test_preempted_request_resumes_with_its_output_recomputed():
    eng, ex = create_engine(
        num_blocks=8, block_size=4, enable_prefix_caching=False, max_num_batched_tokens=32
    )
    reqs = create_requests(3, prompt_len=8, output_len=6)
    steps = run(eng, [(0.0, r) for r in reqs])
    assert sum(st.num_preempted for st in steps) > 0
    for r in reqs:  # the fake executor checked every context; outputs are complete
        assert r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 6


@pytest.mark.parametrize("victim, expected", [("newest", "r1"), ("least_computed", "r2")])
def test_victim_choice(victim, expected):
    s = create_scheduler(
        FCFS(victim=victim), num_blocks=6, block_size=4, enable_prefix_caching=False
    )
    a, b = create_requests(2, prompt_len=8, output_len=12)
    c = create_requests(1, prompt_len=4, output_len=20, start=2)[0]
    for r in (c, a, b):  # c arrives first but has computed the least
        s.add_request(r, 0)
    step(s)  # c: 1 block, a: 2, b: 2; one free
    so, _ = step(s)  # c takes the free block; a needs a third
    assert so.preempted_req_ids == [expected]


def test_requests_that_can_never_fit_are_rejected_with_a_reason():
    s = create_scheduler(num_blocks=4, block_size=4, max_model_len=32)
    too_long = create_requests(1, prompt_len=40)[0]
    too_big = create_requests(1, prompt_len=10, output_len=20, start=1)[0]
    empty = Request(request_id="e", prompt_token_ids=[])
    ok = create_requests(1, prompt_len=4, output_len=4, start=2)[0]
    assert not s.add_request(too_long, 0)
    assert not s.add_request(too_big, 0)
    assert not s.add_request(empty, 0)
    assert s.add_request(ok, 0)
    assert "max_model_len" in too_long.reject_reason
    assert "needs 8 KV blocks but the cache has 4" in too_big.reject_reason
    assert empty.reject_reason == "empty prompt"
    assert all(r.status is RequestStatus.REJECTED for r in (too_long, too_big, empty))
    _, finished = step(s)
    assert finished == []  # the caller was told at once


def test_stop_conditions():
    s = create_scheduler(max_model_len=12)
    eos = Request(
        request_id="eos",
        prompt_token_ids=[1, 2],
        eos_token_id=EOS,
        sampling_params=SamplingParams(max_tokens=10),
    )
    ign = Request(
        request_id="ign",
        prompt_token_ids=[1, 2],
        eos_token_id=EOS,
        sampling_params=SamplingParams(max_tokens=3, ignore_eos=True),
    )
    stop = Request(
        request_id="stop",
        prompt_token_ids=[1, 2],
        sampling_params=SamplingParams(max_tokens=10, stop_token_ids=(5,)),
    )
    trace = Request(
        request_id="trace",
        num_prompt_tokens=2,
        target_output_tokens=2,
        sampling_params=SamplingParams(max_tokens=None, ignore_eos=True),
    )
    ctx = Request(
        request_id="ctx",
        prompt_token_ids=list(range(10)),
        sampling_params=SamplingParams(max_tokens=None),
    )
    for r in (eos, ign, stop, trace, ctx):
        s.add_request(r, 0)
    _, fin = step(s, tokens={"eos": [EOS], "ign": [EOS], "stop": [4]})
    assert [r.request_id for r in fin] == ["eos"] and eos.finish_reason == "stop"
    _, fin = step(s, tokens={"ign": [EOS], "stop": [5]})
    assert {r.request_id for r in fin} == {"stop", "trace", "ctx"}
    assert trace.num_output_tokens == 2 and trace.status is RequestStatus.FINISHED_LENGTH
    assert ctx.num_tokens == 12 and ctx.finish_reason == "length"
    _, fin = step(s, tokens={"ign": [EOS]})
    assert [r.request_id for r in fin] == ["ign"] and ign.output_token_ids == [EOS] * 3


def test_timestamps_are_stamped_at_step_end():
    s = create_scheduler(max_num_batched_tokens=4)
    (r,) = create_requests(1, prompt_len=6, output_len=2)
    r.arrival_time = 0.5
    s.add_request(r, 0.5)
    step(s, now=1.0)  # a 4-token chunk: no token yet
    assert r.first_scheduled_time == 1.0 and r.first_token_time is None
    step(s, now=2.0)
    step(s, now=3.0)
    assert r.first_token_time == 2.0 and list(r.token_times) == [2.0, 3.0]
    assert r.finish_time == 3.0


def test_prefix_cache_hits_count_and_skip_compute():
    s = create_scheduler(num_blocks=32, block_size=4)
    prefix = list(range(100, 112))
    a, b = create_requests(2, prompt_len=14, output_len=2, prefix=prefix)
    s.add_request(a, 0)
    step(s)
    s.add_request(b, 0)
    so, _ = step(s)
    assert b.num_cached_tokens == 12 and scheduled(so)["r1"] == 2
    assert s.kv.stats.hits == 12 and s.kv.stats.queries == 28


def test_blocks_computed_in_a_requests_last_step_stay_cached():
    s = create_scheduler(num_blocks=32, block_size=4)
    a, b = create_requests(2, prompt_len=13, output_len=1, prefix=list(range(12)))
    s.add_request(a, 0)
    _, finished = step(s)  # whole prompt and the only token in one step
    assert finished == [a] and s.kv.num_free_blocks == 32
    s.add_request(b, 0)
    step(s)
    assert b.num_cached_tokens == 12


def test_speculative_decoding_budget_lookahead_and_rollback():
    s = create_scheduler(num_lookahead_tokens=3, max_num_batched_tokens=64)
    (r,) = create_requests(1, prompt_len=4, output_len=20)
    s.add_request(r, 0)
    step(s)  # prefill: 4 tokens + 3 lookahead slots -> 2 blocks of 4
    assert len(s.kv.get_block_ids("r0")) == 2
    r.spec_token_ids = [1, 2, 3]
    so = s.schedule(0)
    assert scheduled(so) == {"r0": 4} and so.spec_token_ids == {"r0": [1, 2, 3]}
    assert r.num_computed_tokens == 8
    # One draft accepted, then a correction: 2 tokens; 2 drafts rolled back.
    s.update_from_output(so, ExecutorOutput(sampled_token_ids=[[1, 9]]), 0)
    assert r.output_token_ids == [7, 1, 9] and r.num_computed_tokens == 6
    assert r.num_draft_tokens == 3 and r.num_accepted_tokens == 1


def test_drafts_are_kept_up_to_the_policys_cap_and_the_requests_end_and_counted():
    class HalfUnderLoad(FCFS):
        def draft_cap(self, request):
            return 1 if request.request_id == "r1" else None

    s = create_scheduler(HalfUnderLoad(), num_speculative_tokens=3, max_num_batched_tokens=64)
    a, b = create_requests(2, prompt_len=4, output_len=4)
    s.add_request(a, 0)
    s.add_request(b, 0)
    so = s.schedule(0)
    proposed = {"r0": [5, 6, 7, 8], "r1": [5, 6, 7]}  # r0's fourth is past k
    s.update_from_output(so, ExecutorOutput([[7], [7]], draft_token_ids=proposed), 0)
    assert a.spec_token_ids == [5, 6] and b.spec_token_ids == [5]  # r0: 2 to its end
    stats = s.spec_stats
    assert stats.offered_per_pos == [2, 1] and stats.proposed_per_pos == [2, 1]
    so = s.schedule(0)
    assert so.spec_token_ids == {"r0": [5, 6], "r1": [5]}
    s.update_from_output(so, ExecutorOutput([[5, 9], [4]]), 0)  # r0: 1 of 2, r1: 0 of 1
    assert stats.num_drafts == 2 and stats.num_draft_tokens == 3
    assert stats.num_accepted_tokens == 1 and stats.mean_acceptance_length == 1.5
    assert stats.drafted_per_pos == [2, 1] and stats.accepted_per_pos == [1]
    assert stats.verified_per_pos == [2, 1]
    assert [row["acceptance_rate"] for row in stats.table()] == [0.5, 0.0]


def test_budget_cuts_drafts_not_the_request():
    s = create_scheduler(num_lookahead_tokens=4, max_num_batched_tokens=3)
    (r,) = create_requests(1, prompt_len=3, output_len=20)
    s.add_request(r, 0)
    step(s)
    r.spec_token_ids = [1, 2, 3, 4]
    so = s.schedule(0)
    assert scheduled(so) == {"r0": 3} and so.spec_token_ids == {"r0": [1, 2]}


def test_remote_kv_requests_wait_for_their_kv_then_decode():
    eng, ex = create_engine(num_blocks=16, block_size=4)
    (r,) = create_requests(1, prompt_len=9, output_len=4)
    r.output_token_ids.append(5)  # the first token, sampled by the prefill instance
    r.remote_kv_tokens = 9
    steps = run(eng, [(0.0, r)])
    first = steps[0].scheduler_output
    assert first.kv_loads and not first.requests  # blocks handed to the connector
    assert r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 4
    assert sum(st.num_prefill_tokens for st in steps) == 0  # nothing recomputed


def test_abort_frees_blocks():
    s = create_scheduler()
    a, b = create_requests(2)
    s.add_request(a, 0)
    s.add_request(b, 0)
    step(s)
    s.abort_request("r0", 1.0)
    assert a.status is RequestStatus.FINISHED_ABORTED and s.kv.get_block_ids("r0") == []
    so, finished = step(s)
    assert "r0" in so.finished_req_ids and a in finished


def test_a_step_with_nothing_to_do_does_not_call_the_executor():
    eng, ex = create_engine()
    res = eng.step()
    assert res.num_reqs == 0 and ex.steps == []
