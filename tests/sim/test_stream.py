"""A simulation fed a request stream: the same run as from a list, holding only
the requests in flight."""

from __future__ import annotations

import gc

import pandas as pd
import pytest

from testbed.build import model_spec, run_trace
from testbed.core import Request
from testbed.metrics.records import RequestRecords, requests_frame
from testbed.metrics.summary import summarize
from testbed.modes.sim import simulate
from testbed.workload import RequestStream, to_requests
from tests.sim.helpers import QUIET, compose_cfg
from traces import traces_dir


def both(*overrides: str):
    cfg = compose_cfg(*QUIET, *overrides)
    spec = model_spec(cfg.model)
    trace = run_trace(cfg)
    listed, _ = simulate(cfg, to_requests(trace, seed=cfg.seed), spec)
    streamed, _ = simulate(cfg, RequestStream(trace), spec)
    return listed, streamed


@pytest.mark.parametrize(
    "overrides",
    [
        ["trace.num_requests=300", "trace.rate=6"],
        ["trace.num_requests=300", "trace.rate=30", "cluster=replicas4"],
        # Stopped part-way: the unfinished and the not yet arrived are recorded too.
        ["trace.num_requests=300", "trace.rate=6", "mode.max_sim_time_s=20"],
        ["trace=mooncake_conv", "trace.num_requests=200", "engine.num_kv_blocks=300"],
    ],
)
def test_a_streamed_run_is_the_listed_run(overrides):
    if "trace=mooncake_conv" in overrides and not traces_dir().exists():
        pytest.skip(f"shared traces not found at {traces_dir()} (set TESTBED_TRACES_DIR)")
    listed, streamed = both(*overrides)
    assert isinstance(streamed.requests, RequestRecords)
    pd.testing.assert_frame_equal(
        requests_frame(streamed.requests), requests_frame(listed.requests)
    )
    assert summarize(streamed) == summarize(listed)
    assert streamed.partial == listed.partial


def test_a_streamed_run_lets_its_requests_go():
    def alive() -> int:  # other tests may leave requests of their own behind
        gc.collect()
        return sum(type(o) is Request for o in gc.get_objects())

    cfg = compose_cfg(*QUIET, "trace.num_requests=300", "trace.rate=6")
    stream = RequestStream(run_trace(cfg))
    before = alive()
    result, _ = simulate(cfg, stream, model_spec(cfg.model))
    assert len(result.requests) == 300 and alive() == before
