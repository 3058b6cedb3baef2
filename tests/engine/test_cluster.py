"""Real engine processes behind a router (mode=real, cluster.num_replicas > 1):
greedy outputs equal one engine's, and a worker that dies has its requests
served by the others."""

from __future__ import annotations

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
