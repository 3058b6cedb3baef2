"""A closed loop (trace=concurrency): C clients, each sending its next request
when its last one ends, in the simulator; the trace that describes it."""

from __future__ import annotations

import filecmp

import numpy as np
import pandas as pd
import pytest

from testbed.core import (
    Request,
    RequestStatus,
    SamplingParams,
)
from testbed.errors import InputError
from testbed.workload import ClosedLoop
from tests.sim import helpers
from tests.sim.helpers import observable, random_requests, run
from traces import load_trace, max_concurrency

# --- the trace ---


def test_the_trace_lists_requests_in_send_order_and_says_it_is_a_closed_loop():
    df = load_trace("concurrency", max_concurrency=4, num_requests=10, prompt_tokens=100)
    assert max_concurrency(df) == 4 and len(df) == 10
    assert (df["arrival_s"] == 0).all()  # a run stamps when each is sent
    assert (df["prompt_tokens"] == 100).all() and (df["output_tokens"] == 128).all()
    assert max_concurrency(load_trace("synthetic", num_requests=5)) is None


def test_lengths_from_a_distribution_are_seeded():
    spec = {"dist": "lognormal", "mean": 300, "cv": 1.0}
    a, b, c = (
        load_trace("concurrency", max_concurrency=2, num_requests=50, prompt=spec, seed=s)
        for s in (0, 0, 1)
    )
    assert a["prompt_tokens"].equals(b["prompt_tokens"])
    assert not a["prompt_tokens"].equals(c["prompt_tokens"])
    assert a["prompt_tokens"].nunique() > 10 and (a["output_tokens"] == 128).all()


def test_lengths_from_a_length_file_are_its_first_rows_in_order(tmp_path):
    path = tmp_path / "lengths.csv"
    rows = pd.DataFrame({"num_prefill_tokens": [5, 90, 7, 300], "num_decode_tokens": [3, 1, 8, 2]})
    rows.to_csv(path, index=False)
    df = load_trace("concurrency", max_concurrency=2, num_requests=3, lengths_from=str(path))
    assert df["prompt_tokens"].tolist() == [5, 90, 7]
    assert df["output_tokens"].tolist() == [3, 1, 8]
    with pytest.raises(ValueError, match="has 4 rows; num_requests=5"):
        load_trace("concurrency", max_concurrency=2, num_requests=5, lengths_from=str(path))


@pytest.mark.parametrize(
    "options, message",
    [
        ({"prompt_tokens": 5, "prompt": {"dist": "fixed", "value": 4}}, "give one"),
        ({"lengths_from": "x.csv", "output_tokens": 4}, r"drop \['output_tokens'\]"),
        ({"rate": 4.0}, r"no arrival times for \['rate'\]"),
        ({"time_scale": 2.0, "window_end_s": 9.0}, r"\['time_scale', 'window_end_s'\]"),
        ({"max_concurrency": 0}, "max_concurrency must be >= 1"),
    ],
)
def test_options_that_do_not_fit_a_closed_loop_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        load_trace("concurrency", **{"max_concurrency": 3, **options})


# --- the simulator ---


def simulate(requests, clients, fast_forward=True, replicas=1, router="round_robin", **limits):
    """A closed loop of ``clients`` over ``requests`` under FCFS (the helpers' simulation)."""
    result, _ = helpers.simulate(
        requests,
        fast_forward=fast_forward,
        replicas=replicas,
        router=router,
        max_concurrency=clients,
        **limits,
    )
    return result


def same_lengths(n: int, prompt: int = 512, output: int = 128) -> list[Request]:
    """Requests alike: replicas given the same share finish in step with each other."""
    params = SamplingParams(max_tokens=None, ignore_eos=True)
    return [
        Request(
            f"r{i}", num_prompt_tokens=prompt, target_output_tokens=output, sampling_params=params
        )
        for i in range(n)
    ]


SETUPS = {
    "one replica": dict(),
    "one replica, tight KV (preemptions)": dict(num_blocks=700),
    "three replicas, jumps cut by deliveries": dict(replicas=3, num_blocks=2000),
    "two replicas whose caches the router reads (stepped)": dict(replicas=2, router="prefix_cache"),
}


@pytest.mark.parametrize("setup", SETUPS, ids=list(SETUPS))
@pytest.mark.parametrize("clients", [1, 8, 40])
def test_fast_path_equals_stepping_in_a_closed_loop(setup, clients):
    fast = simulate(random_requests(150), clients, True, **SETUPS[setup])
    slow = simulate(random_requests(150), clients, False, **SETUPS[setup])
    arrivals = [r.arrival_time for r in fast.requests]
    assert arrivals == [r.arrival_time for r in slow.requests]
    assert observable(fast.requests) == observable(slow.requests)
    assert fast.steps.to_frame().equals(slow.steps.to_frame())
    if setup == "one replica" and clients == 8:
        assert fast.num_jumped_steps > len(fast.steps) // 2  # the fast path did the work


@pytest.mark.parametrize("setup", SETUPS, ids=list(SETUPS))
@pytest.mark.parametrize("clients", [1, 8, 40])
def test_each_client_sends_its_next_request_when_its_last_ends(setup, clients):
    result = simulate(random_requests(150), clients, **SETUPS[setup])
    reqs = result.requests
    n = len(reqs)
    arrival = np.array([r.arrival_time for r in reqs])
    finish = np.array([r.finish_time for r in reqs])
    assert all(r.is_finished for r in reqs)
    assert (arrival[:clients] == 0).all() and (np.diff(arrival) >= 0).all()  # rows in order
    # Every finish but the last C's sends the next row, at that finish's time.
    assert arrival[clients:].tolist() == np.sort(finish)[: n - clients].tolist()
    # In the system (arrived, not finished): C at every moment until the last is sent.
    for t in np.unique(np.concatenate([arrival, finish])):
        inside = int(((arrival <= t) & (finish > t)).sum())
        assert inside == clients if t < arrival.max() else inside <= clients


def test_a_rejected_request_frees_its_client_at_once():
    reqs = random_requests(60)
    reqs[3].num_prompt_tokens = 9000  # beyond max_model_len: rejected as it arrives
    result = simulate(reqs, 2, max_model_len=8192)
    bad = result.requests[3]
    assert bad.status == RequestStatus.REJECTED and bad.finish_time == bad.arrival_time
    sent_then = [r for r in result.requests[4:] if r.arrival_time == bad.finish_time]
    assert sent_then, "no request was sent as the rejected one was refused"
    assert sent_then[0].first_scheduled_time == bad.finish_time  # in the step starting then


def test_requests_sent_as_others_end_on_other_replicas_are_scheduled_then():
    """Two replicas in step: the requests that their simultaneous finishes send all
    start with the replicas' next steps, whatever order simpy reports the ends in."""
    for fast_forward in (True, False):
        result = simulate(same_lengths(40), 8, fast_forward, replicas=2)
        late = [r.request_id for r in result.requests if r.first_scheduled_time != r.arrival_time]
        assert late == []


def test_every_request_at_once_when_the_clients_outnumber_them():
    result = simulate(random_requests(30), 50)
    assert all(r.arrival_time == 0 for r in result.requests)


def test_closed_loop_sends_in_client_order_whatever_order_ends_are_reported():
    params = SamplingParams(max_tokens=None, ignore_eos=True)
    reqs = [Request(f"q{i}", num_prompt_tokens=4, sampling_params=params) for i in range(5)]
    loop = ClosedLoop(enumerate(reqs), 2)
    assert [row for row, _ in loop.send(0.0)] == [0, 1] and loop.next_time == np.inf
    reqs[1].finish_time, reqs[0].finish_time = 2.0, 2.0
    loop.ended(reqs[1], 1.0)  # a jump reports a finish ahead of its time
    loop.ended(reqs[0], 1.0)
    assert loop.next_time == 2.0 and list(loop.send(1.5)) == []
    assert [(row, r.arrival_time) for row, r in loop.send(2.0)] == [(2, 2.0), (3, 2.0)]
    reqs[2].finish_time = 2.5
    loop.ended(reqs[2], 3.0)  # an end seen after it happened: sent when seen
    assert [(row, r.arrival_time) for row, r in loop.send(3.0)] == [(4, 3.0)]
    assert loop.done and list(loop.unsent()) == []


# --- through run.py's path ---

CLOSED = [
    "trace=concurrency",
    "trace.max_concurrency=6",
    "trace.num_requests=40",
    "trace.prompt={dist: lognormal, mean: 300, cv: 1.0, max: 1500}",
    "trace.output={dist: lognormal, mean: 60, cv: 1.0, max: 300}",
]


@pytest.mark.parametrize(
    "cluster",
    [
        [],
        ["cluster=replicas2"],
        ["cluster=disagg", "cluster.num_prefill=1", "cluster.num_decode=2"],
    ],
    ids=["single", "replicas2", "1P2D"],
)
def test_a_closed_loop_run_writes_the_same_files_with_and_without_the_fast_path(tmp_path, cluster):
    fast = run(tmp_path, *CLOSED, *cluster, "mode.fast_forward=true", name="fast")
    run(tmp_path, *CLOSED, *cluster, "mode.fast_forward=false", name="slow")
    for table in ("requests.csv", "steps.csv"):
        assert filecmp.cmp(tmp_path / "fast" / table, tmp_path / "slow" / table, shallow=False)
    assert fast["trace_max_concurrency"] == 6 and fast["num_finished"] == 40
    arrival = pd.read_csv(tmp_path / "fast" / "requests.csv")["arrival_s"]
    assert (arrival[:6] == 0).all() and (arrival[6:] > 0).all()  # the send times


def test_a_run_stopped_part_way_marks_requests_never_sent(tmp_path):
    metrics = run(tmp_path, *CLOSED, "mode.max_sim_time_s=0.5")
    df = pd.read_csv(tmp_path / "run" / "requests.csv")
    assert metrics["partial"] is True and len(df) == 40
    assert df["arrival_s"].isna().any() and df["arrival_s"].notna().sum() >= 6


def test_load_is_refused_with_a_closed_loop(tmp_path):
    with pytest.raises(InputError, match=r"load=0.7 .*trace.max_concurrency=6"):
        run(tmp_path, *CLOSED, "load=0.7")
