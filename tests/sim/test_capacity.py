"""`load=`: a trace replayed at a fraction of the engine's capacity, found in simulation."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from testbed.build import model_spec, run_trace
from testbed.capacity import (
    SUSTAINED,
    WARM_UP,
    bracket,
    cache_key,
    find_capacity,
    scaled_to_load,
    search_config,
    sustains,
)
from testbed.metrics.summary import GROWTH_SPREADS, backlog_trend
from tests.sim.helpers import QUIET, compose_cfg, run
from tests.traces.conftest import SHARED_FILES, shared_path
from traces.transforms import mean_rate

SHORT = ["trace.num_requests=60"]


def kept_up(run_dir) -> bool:
    """The definition, read off a whole run's requests.csv: from the arrival of
    the first quarter's last request to the last arrival, at least 95% as many
    admitted requests finish as arrive, but for the last, or the number in
    flight does not grow by more than three spreads about its trend."""
    reqs = pd.read_csv(run_dir / "requests.csv")
    arrivals = np.sort(reqs["arrival_s"].to_numpy())
    start, last = arrivals[int(WARM_UP * len(arrivals))], arrivals[-1]
    admitted = reqs[reqs["status"] != "rejected"]
    arrived = admitted["arrival_s"].between(start, last).sum()
    done = admitted["status"].str.startswith("finished") & admitted["finish_s"].between(start, last)
    growth, spread = backlog_trend(admitted, start, last)
    return done.sum() + 1 >= SUSTAINED * arrived or not growth > GROWTH_SPREADS * spread


def test_load_replays_at_that_fraction_of_a_capacity_whole_runs_confirm(tmp_path):
    m = run(tmp_path, *SHORT, "load=0.6", "capacity_cache=null", name="load")
    cap = m["capacity_req_s"]
    assert m["load"] == 0.6 and m["rate_req_s"] == pytest.approx(0.6 * cap)
    assert m["capacity_from"] == "searched"
    cfg = compose_cfg(*QUIET, *SHORT)
    spec = model_spec(cfg.model)
    lo, hi = bracket(cfg, spec, start_rate=mean_rate(run_trace(cfg)))
    assert lo == cap and 1 < hi / lo < 1.005
    # Whole simulations (to their last finish) at the two ends of the bracket.
    run(tmp_path, *SHORT, f"trace.rate={lo}", name="lo")
    run(tmp_path, *SHORT, f"trace.rate={hi}", name="hi")
    assert kept_up(tmp_path / "lo") and not kept_up(tmp_path / "hi")
    # A synthetic trace's rate is its generator's: the arrivals realise it up to
    # chance, the same for every rate (one seed), so loads are in proportion.
    at = run(tmp_path, *SHORT, f"trace.rate={cap}", name="at")
    assert m["offered_req_s"] / at["offered_req_s"] == pytest.approx(0.6)


def test_a_stopped_try_decides_as_the_whole_simulation_would(tmp_path):
    cfg = compose_cfg(*QUIET, *SHORT)
    spec = model_spec(cfg.model)
    cap = find_capacity(cfg, spec, start_rate=1.0)
    for factor in (0.5, 0.97, 1.0, 1.02, 1.2, 3.0):
        rate = factor * cap
        run(tmp_path, *SHORT, f"trace.rate={rate}", name=f"r{factor}")
        assert sustains(search_config(cfg), spec, rate) == kept_up(tmp_path / f"r{factor}")


def test_a_burst_still_in_service_at_the_last_arrival_is_not_a_backlog():
    """Azure conv's first 100 requests end in a burst: five arrive in the
    window's last 4%. On an engine that sustains several requests a second they
    are still in service at the last arrival, one fewer finished than the 95%
    count allows, at every rate from 0.16 req/s up; the number in flight does
    not grow, so the engine is not behind."""
    shared_path(SHARED_FILES["azure_conv"])  # skips, naming it, where the trace is absent
    cfg = compose_cfg(
        *QUIET,
        "model=llama3-70b",
        "hardware=h100",
        "trace=azure_conv",
        "trace.num_requests=100",
        "engine.tensor_parallel_size=8",
    )
    spec = model_spec(cfg.model)
    assert sustains(search_config(cfg), spec, 0.5)
    assert not sustains(search_config(cfg), spec, 8.0)  # 40 of 75 finish, in flight grows
    assert 1.0 < find_capacity(cfg, spec) < 2.0


def test_a_machine_twice_as_slow_has_half_the_capacity(tmp_path):
    """Steps twice as long and arrivals twice as far apart are the same schedule."""
    spec = model_spec(compose_cfg(*QUIET).model)
    cap = find_capacity(compose_cfg(*QUIET, *SHORT), spec, start_rate=2.0)
    slow = compose_cfg(*QUIET, *SHORT, "mode.latency_scale=2")
    assert find_capacity(slow, spec, start_rate=2.0) == pytest.approx(cap / 2, rel=0.01)


def test_every_policy_of_a_sweep_gets_one_capacity_searched_once(tmp_path):
    cache = f"capacity_cache={tmp_path / 'cache'}"
    first = run(tmp_path, *SHORT, "load=0.5", cache, "policy=fcfs", name="a")
    again = run(tmp_path, *SHORT, "load=0.9", cache, "policy=sjf", name="b")
    fresh = run(tmp_path, *SHORT, "load=0.9", "capacity_cache=null", "policy=sjf", name="c")
    assert first["capacity_from"] == "searched" and again["capacity_from"].startswith("cached")
    assert first["capacity_req_s"] == again["capacity_req_s"] == fresh["capacity_req_s"]
    assert again["rate_req_s"] == pytest.approx(0.9 * first["capacity_req_s"])
    # Another engine config is another capacity, not the cached one.
    slow = run(tmp_path, *SHORT, "load=0.5", cache, "mode.latency_scale=3", name="d")
    assert slow["capacity_from"] == "searched"
    assert slow["capacity_req_s"] < first["capacity_req_s"] / 2


def test_the_search_runs_fcfs_in_simulation_whatever_the_run(tmp_path):
    real = search_config(compose_cfg(*QUIET, "mode=real", "policy=sjf"))
    assert real.mode.name == "sim" and real.mode.latency_scale == 1.0
    assert real.policy.name == "fcfs" and real.progress is False
    scaled = search_config(compose_cfg(*QUIET, "mode.latency_scale=1.5", "mode.speed_trace=x.csv"))
    assert scaled.mode.latency_scale == 1.5 and scaled.mode.speed_trace is None


def test_a_trace_the_engine_rejects_entirely_has_no_capacity(tmp_path):
    with pytest.raises(ValueError, match="rejects every request"):
        run(tmp_path, *SHORT, "load=0.7", "capacity_cache=null", "engine.max_model_len=4")


def test_the_cache_key_follows_what_the_capacity_depends_on():
    def key(*overrides: str) -> str:
        cfg = compose_cfg(*QUIET, *SHORT, *overrides)
        return cache_key(cfg, run_trace(cfg), "profile x")

    base = key()
    assert key("policy=sjf") == key("load=0.9") == key("logging=offline") == base
    for other in (
        "trace.num_requests=61",
        "trace.max_model_len=300",
        "seed=1",
        "engine.max_num_seqs=8",
        "cluster=replicas4",
        "hardware=cpu1",
        "mode.latency_scale=2",
    ):
        assert key(other) != base, other
    cfg = compose_cfg(*QUIET, *SHORT)
    assert cache_key(cfg, run_trace(cfg), "profile y") != base


class Failing:
    """A latency model that fails (or is interrupted) on its first prediction."""

    kind, source = "profile", "failing"

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __getattr__(self, name):
        raise self.exc


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), RuntimeError("boom")])
def test_a_search_interrupted_or_failing_stops_and_caches_nothing(tmp_path, monkeypatch, exc):
    for module in ("testbed.capacity", "testbed.modes.sim"):  # the cache key's, the search's
        monkeypatch.setattr(f"{module}.latency_model", lambda cfg, spec=None: Failing(exc))
    cfg = compose_cfg(*QUIET, *SHORT, "load=0.7", f"capacity_cache={tmp_path}")
    with pytest.raises(type(exc)):
        scaled_to_load(cfg, model_spec(cfg.model))
    assert not list(tmp_path.iterdir())


def test_a_load_that_cannot_be_is_refused_before_searching(tmp_path):
    cfg = compose_cfg(*QUIET, *SHORT, "load=0", "capacity_cache=null")
    with pytest.raises(ValueError, match="above 0"):
        scaled_to_load(cfg, model_spec(cfg.model))
    cfg = compose_cfg(*QUIET, *SHORT, "load=0.5", "+trace.time_scale=2", "capacity_cache=null")
    with pytest.raises(ValueError, match="time_scale"):
        scaled_to_load(cfg, model_spec(cfg.model))
    cfg = compose_cfg(*QUIET, "trace.num_requests=8", "load=0.5", "capacity_cache=null")
    with pytest.raises(ValueError, match="has 8 requests"):
        scaled_to_load(cfg, model_spec(cfg.model))
