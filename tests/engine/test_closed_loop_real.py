"""A closed loop (trace=concurrency) on the real engine: each client's next
request is sent once its last one has ended, one engine and a cluster."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from policies.routers import make_router
from testbed.core import Request, SamplingParams
from testbed.engine.args import EngineArgs
from testbed.engine.cluster import replay_cluster
from testbed.job import run_from_config
from testbed.models import models_dir
from tests.sim.helpers import compose_cfg

QUIET = ["logging=disabled", "progress=false", "plots=false"]


def check_closed_loop(arrival: np.ndarray, finish: np.ndarray, clients: int) -> None:
    """The first C sent at 0, the rest in order, each no sooner than a finish
    frees its client; never more than C in the engine (arrived, not finished)."""
    n = len(arrival)
    assert (arrival[:clients] == 0).all() and (np.diff(arrival) >= 0).all()
    assert (arrival[clients:] >= np.sort(finish)[: n - clients]).all()
    for t in np.unique(np.concatenate([arrival, finish])):
        assert int(((arrival <= t) & (finish > t)).sum()) <= clients


def test_one_engine_sends_each_request_as_its_clients_last_ends(tmp_path):
    overrides = ["mode=real", "trace=concurrency", "trace.max_concurrency=3"]
    overrides += ["trace.num_requests=9", "trace.prompt_tokens=24", "trace.output_tokens=8"]
    bare = f"profiles_dir={tmp_path / 'none'}"  # no profile to fit the run's steps to
    metrics = run_from_config(compose_cfg(*overrides, *QUIET, bare), tmp_path / "run")
    assert metrics["trace_max_concurrency"] == 3 and metrics["num_finished"] == 9
    reqs = pd.read_csv(tmp_path / "run" / "requests.csv")
    arrival, finish = reqs["arrival_s"].to_numpy(), reqs["finish_s"].to_numpy()
    check_closed_loop(arrival, finish, 3)
    # Sent between steps: each is scheduled by the first step that starts after it.
    starts = np.sort(pd.read_csv(tmp_path / "run" / "steps.csv")["start_s"].to_numpy())
    first_step = starts[np.searchsorted(starts, arrival)]
    assert reqs["first_scheduled_s"].tolist() == first_step.tolist()


def test_a_cluster_sends_each_request_as_its_clients_last_comes_back():
    folder = models_dir() / "stories260K" / "hf"
    if not (folder / "config.json").exists():
        pytest.skip(f"stories260K not found at {folder} (set TESTBED_MODELS_DIR)")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    reqs = [
        Request(f"c{i}", prompt_token_ids=[1, 5 + i, 9], sampling_params=params) for i in range(8)
    ]
    args = EngineArgs(model=str(folder), max_num_seqs=4)
    result = replay_cluster(args, reqs, 2, make_router("round_robin"), max_concurrency=2)
    assert not result.partial and result.stop_reason == "finished"
    assert [r.request_id for r in result.requests] == [f"c{i}" for i in range(8)]
    arrival = np.array([r.arrival_time for r in result.requests])
    finish = np.array([r.finish_time for r in result.requests])
    check_closed_loop(arrival, finish, 2)
    assert set(result.steps.to_frame().replica) == {0, 1}  # both served
