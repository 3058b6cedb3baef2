"""Real engine processes behind a router (mode=real, cluster.num_replicas > 1):
greedy outputs equal one engine's, and a worker that dies has its requests
served by the others."""

from __future__ import annotations

import functools
import os
import re
import signal

import pytest

from policies.routers import make_router
from testbed.core import Request, SamplingParams
from testbed.engine.args import EngineArgs
from testbed.engine.cluster import replay_cluster
from testbed.engine.llm import LLM
from testbed.models import models_dir


def stories() -> str:
    folder = models_dir() / "stories260K" / "hf"
    if not (folder / "config.json").exists():
        pytest.skip(f"stories260K not found at {folder} (set TESTBED_MODELS_DIR)")
    return str(folder)


def prompts(n: int) -> list[list[int]]:
    """Held-out prompts: token ids no other test uses, some sharing a prefix."""
    import random

    rng = random.Random(77)
    shared = [1] + [rng.randrange(3, 500) for _ in range(12)]
    return [
        (shared if i % 3 == 0 else [1]) + [rng.randrange(3, 500) for _ in range(rng.randint(4, 30))]
        for i in range(n)
    ]


def requests(n: int, max_tokens: int = 24, gap_s: float = 0.01) -> list[Request]:
    return [
        Request(
            f"q{i}",
            prompt_token_ids=p,
            sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
            arrival_time=i * gap_s,
        )
        for i, p in enumerate(prompts(n))
    ]


def alone(n: int, max_tokens: int = 24) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.token_ids for o in LLM(stories()).generate(prompts(n), params)]


def test_greedy_outputs_of_two_engine_processes_are_one_engines():
    args = EngineArgs(model=stories(), max_num_seqs=8)
    result = replay_cluster(args, requests(16), 2, make_router("round_robin"))
    assert not result.partial and result.stop_reason == "finished"
    assert [list(r.output_token_ids) for r in result.requests] == alone(16)
    replicas = set(result.steps.to_frame().replica)
    assert replicas == {0, 1}  # both served
    assert all(r.first_token_time >= r.arrival_time for r in result.requests)


def test_a_worker_that_dies_has_its_requests_served_by_the_other():
    args = EngineArgs(model=stories(), max_num_seqs=4)
    reqs = requests(12, max_tokens=200, gap_s=0.0)
    victim: list[int] = []

    def kill_engine_1(now: float, num_done: int) -> None:
        # When the first request is back: both engines are serving.
        import multiprocessing

        if not victim:
            (kid,) = [p for p in multiprocessing.active_children() if p.name == "engine-1"]
            victim.append(kid.pid)
            os.kill(kid.pid, signal.SIGKILL)

    result = replay_cluster(args, reqs, 2, make_router("round_robin"), on_progress=kill_engine_1)
    assert victim, "engine-1 was never seen"
    lost = re.search(
        r"engine-1 died \(exit code -9\): its (\d+) outstanding requests sent", result.stop_reason
    )
    assert lost and int(lost.group(1)) > 0, result.stop_reason
    assert all(r.finish_time is not None for r in result.requests), (
        result.stop_reason,
        [r for r in result.requests if r.finish_time is None],
    )
    assert [list(r.output_token_ids) for r in result.requests] == alone(12, max_tokens=200)


def test_a_multi_process_run_stopped_by_sigterm_writes_what_it_measured(tmp_path):
    """SIGTERM to run.py stops every engine process and the run still writes its
    files, marked partial."""
    import json

    import pandas as pd

    from tests.sim.helpers import run_and_signal

    args = [
        "mode=real", "cluster.num_replicas=2", "trace.num_requests=400", "trace.rate=4",
        "logging=disabled", "plots=false",
    ]  # fmt: skip
    status, out, err = run_and_signal(args, signal.SIGTERM, tmp_path)
    assert status == 143, err[-2000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["partial"] is True and metrics["stop_reason"] == "interrupted"
    assert 0 < metrics["num_finished"] < 400
    assert len(pd.read_csv(tmp_path / "requests.csv")) == 400
    steps = pd.read_csv(tmp_path / "steps.csv")
    assert set(steps.replica) == {0, 1}


def test_greedy_outputs_of_one_prefill_and_one_decode_process_are_one_engines():
    """1P1D: every prompt computed on the prefill process, its KV sent over
    torch.distributed (gloo) to the decode process, which computes only the last
    prompt token and decodes: token for token what one engine gives."""
    args = EngineArgs(model=stories(), max_num_seqs=8)
    result = replay_cluster(args, requests(12), 2, make_router("round_robin"), num_prefill=1)
    assert not result.partial and result.stop_reason == "finished"
    assert [list(r.output_token_ids) for r in result.requests] == alone(12)
    steps = result.steps.to_frame()
    prefill, decode = steps[steps.replica == 0], steps[steps.replica == 1]
    assert prefill.num_decode_tokens.sum() == 0
    # The decode process computed one prompt token per request, the rest arrived.
    assert decode.num_prefill_tokens.sum() == 0 and decode.num_decode_tokens.sum() > 0
    for r in result.requests:
        assert r.kv_transfer_end > r.kv_transfer_start >= r.arrival_time
        assert r.kv_transfer_bytes > 0 and r.first_token_time > r.kv_transfer_end


def test_the_uncached_prompt_decider_reads_the_decode_process_cache():
    """mode=real with cluster.decider=uncached_prompt: the decider gets the prompt
    tokens the decode process does not hold (from its KV events), as the
    simulator's does. A short prompt is kept whole and computed on the decode
    process; a later, longer one sharing its first blocks has few uncached tokens
    and stays whole too (the whole prompt is above the threshold); a long prompt
    nothing holds is disaggregated. Outputs stay one engine's."""
    import random

    from policies.deciders import make_decider

    rng = random.Random(5)
    shared = [1] + [rng.randrange(3, 500) for _ in range(79)]
    prompts = [
        shared,  # 80 uncached: whole
        shared + [rng.randrange(3, 500) for _ in range(40)],  # 120 long, 56 uncached: whole
        [1] + [rng.randrange(3, 500) for _ in range(119)],  # 120 uncached: disaggregated
    ]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    reqs = [
        Request(f"u{i}", prompt_token_ids=p, sampling_params=params, arrival_time=1.5 * i)
        for i, p in enumerate(prompts)
    ]
    args = EngineArgs(model=stories(), max_num_seqs=8)
    decider = make_decider("uncached_prompt", threshold=100)
    result = replay_cluster(
        args, reqs, 2, make_router("round_robin"), num_prefill=1, decider=decider
    )
    assert not result.partial and result.stop_reason == "finished"
    whole, shared_prefix, moved = result.requests
    assert whole.kv_transfer_start is None and shared_prefix.kv_transfer_start is None
    assert shared_prefix.num_cached_tokens >= 64  # the decode process's cache held it
    assert moved.kv_transfer_start is not None and moved.kv_transfer_bytes > 0
    expected = [o.token_ids for o in LLM(stories()).generate(prompts, params)]
    assert [list(r.output_token_ids) for r in result.requests] == expected


@functools.cache
def alone_cached(n: int, max_tokens: int = 24) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(t) for t in alone(n, max_tokens))


def kill_when_first_back(name: str, victim: list[int]):
    """An ``on_progress`` that SIGKILLs the worker ``name`` when the first request
    is back (its pid into ``victim``)."""

    def kill(now: float, num_done: int) -> None:
        import multiprocessing

        if not victim:
            (kid,) = [p for p in multiprocessing.active_children() if p.name == name]
            victim.append(kid.pid)
            os.kill(kid.pid, signal.SIGKILL)

    return kill


@pytest.mark.parametrize("kind", ["fail", "hang"])
def test_a_failed_or_timed_out_transfer_is_recomputed_by_the_decode_process(kind):
    """Injected faults on the real KV transfer: a send the prefill process cannot
    make (fail) or never makes (hang, ended by the receive's timeout). Each struck
    request recomputes its prompt on the decode process, its record says so, the
    outputs are still one engine's, and the prefill process frees every block."""
    from testbed.core.kv_faults import KVFaults

    faults = KVFaults(kind, 0.4, seed=5)
    args = EngineArgs(model=stories(), max_num_seqs=8)
    reqs = requests(12)
    result = replay_cluster(
        args, reqs, 2, make_router("round_robin"), num_prefill=1, faults=faults,
        kv_timeout_s=0.5,
    )  # fmt: skip
    assert not result.partial and result.stop_reason == "finished"
    assert tuple(tuple(r.output_token_ids) for r in result.requests) == alone_cached(12)
    struck = {r.request_id for r in reqs if faults.strikes(r.request_id)}
    assert 2 <= len(struck) <= 10
    for r in result.requests:
        assert r.kv_transfer_failed == (r.request_id in struck), r.request_id
        if r.kv_transfer_failed:
            assert r.kv_recomputed_tokens == r.num_prompt_tokens - 1 and r.kv_transfer_bytes == 0
            took = r.kv_transfer_end - r.kv_transfer_start
            assert took >= 0.5 if kind == "hang" else took < 0.5
        else:
            assert r.kv_recomputed_tokens == 0 and r.kv_transfer_bytes > 0
    assert [s["kv_blocks_held"] for s in result.extra["replica_stats"]] == [0, 0]


def test_a_prefill_process_that_dies_mid_transfer_leaves_its_loads_recomputed():
    """Half the transfers hang (a 60 s timeout); the prefill process is killed
    with them under way. The decode process gives up on them at once (the parent
    reports the death), recomputes their prompts, and everything is served as one
    engine serves it (the legs not yet back are sent whole to the decode process)."""
    from testbed.core.kv_faults import KVFaults

    args = EngineArgs(model=stories(), max_num_seqs=8)
    victim: list[int] = []
    result = replay_cluster(
        args, requests(12), 2, make_router("round_robin"), num_prefill=1,
        faults=KVFaults("hang", 0.5, seed=5), kv_timeout_s=60.0,
        on_progress=kill_when_first_back("engine-0", victim),
    )  # fmt: skip
    assert victim and "engine-0 died (exit code -9)" in result.stop_reason
    assert all(r.finish_time is not None for r in result.requests), result.stop_reason
    assert tuple(tuple(r.output_token_ids) for r in result.requests) == alone_cached(12)
    failed = [r for r in result.requests if r.kv_transfer_failed]
    assert failed and all(r.kv_transfer_end - r.kv_transfer_start < 30 for r in failed)
    assert result.extra["replica_stats"][1]["kv_blocks_held"] == 0


def test_a_decode_process_that_dies_has_the_prefill_process_free_its_kv():
    """1P2D, a decode process killed with requests queued whose KV it has not
    pulled yet (two run at a time; paired in turn, so it has half): they are served
    whole by the other decode process, and the prefill process frees the blocks it
    kept for them."""
    args = EngineArgs(model=stories(), max_num_seqs=2)
    victim: list[int] = []
    result = replay_cluster(
        args, requests(12, max_tokens=120, gap_s=0.0), 3, make_router("round_robin"),
        num_prefill=1, pairing=make_router("round_robin"),
        on_progress=kill_when_first_back("engine-1", victim),
    )  # fmt: skip
    lost = re.search(r"engine-1 died \(exit code -9\): its (\d+) outstanding", result.stop_reason)
    assert lost and int(lost.group(1)) > 2, result.stop_reason
    assert all(r.finish_time is not None for r in result.requests), result.stop_reason
    assert tuple(tuple(r.output_token_ids) for r in result.requests) == alone_cached(12, 120)
    prefill, _, decode = result.extra["replica_stats"]
    assert prefill["kv_blocks_held"] == 0 and decode["kv_blocks_held"] == 0


def test_the_kv_groups_backend_follows_the_device_and_can_be_set():
    from testbed.engine.cluster import kv_group_backend
    from testbed.errors import InputError

    cpu = EngineArgs(model="dummy-llama", device="cpu")
    assert kv_group_backend(cpu, 2) == "gloo" and kv_group_backend(cpu, 2, "gloo") == "gloo"
    with pytest.raises(InputError, match="kv_backend=nccl: needs a GPU per engine process"):
        kv_group_backend(cpu, 2, "nccl")
