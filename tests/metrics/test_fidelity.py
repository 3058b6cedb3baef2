"""One definition of a simulation's error against its real run, and of the pair."""

from __future__ import annotations

import math
from operator import itemgetter

import numpy as np
import pandas as pd
import pytest

from testbed.metrics.fidelity import (
    TARGETS,
    join_requests,
    metric_errors,
    pair_key,
    pair_runs,
    relative_error,
    target_misses,
    within_target,
)


def test_the_error_is_the_simulation_over_the_real_run_less_one():
    assert relative_error(1.1, 1.0) == pytest.approx(0.1)
    assert relative_error(0.9, 1.0) == pytest.approx(-0.1)  # not 1 - real / sim
    assert relative_error(3, 4) == pytest.approx(-0.25)


@pytest.mark.parametrize("sim, real", [(1.0, 0.0), (None, 1.0), (1.0, None), (math.nan, 1.0)])
def test_an_error_without_a_real_scale_or_a_measure_is_nan(sim, real):
    assert math.isnan(relative_error(sim, real))


def test_metric_errors_name_each_key_and_leave_nan_where_one_side_lacks_it():
    errors = metric_errors({"a": 2.0, "b": 1.0}, {"a": 4.0, "c": 1.0}, ["a", "b", "c"])
    assert errors["a"] == pytest.approx(-0.5)
    assert math.isnan(errors["b"]) and math.isnan(errors["c"])


def test_a_target_bounds_the_size_of_the_error_either_way_bound_included():
    bound = TARGETS["tpot_s_mean"]
    assert within_target("tpot_s_mean", bound) and within_target("tpot_s_mean", -bound)
    assert not within_target("tpot_s_mean", bound * 1.01)
    assert not within_target("tpot_s_mean", -bound * 1.01)
    assert not within_target("tpot_s_mean", None) and not within_target("tpot_s_mean", math.nan)
    values = np.array([0.0, bound * 1.01, -bound, math.nan])
    assert within_target("tpot_s_mean", values).tolist() == [True, False, True, False]


def test_target_misses_name_each_missed_or_unmeasured_metric_in_target_order():
    errors = dict.fromkeys(TARGETS, 0.0)
    assert target_misses(errors) == {}
    errors.update(ttft_s_p50=0.11, throughput_req_s=math.nan)
    del errors["e2e_s_mean"]
    misses = target_misses(errors)
    assert list(misses) == ["throughput_req_s", "e2e_s_mean", "ttft_s_p50"]
    assert misses["ttft_s_p50"] == 0.11 and misses["e2e_s_mean"] is None


def test_a_setting_is_the_overrides_but_mode_and_its_fields():
    sim = pair_key(["mode=sim", "policy=sjf", "++mode.latency_scale=1.2", "+load=0.7"], {})
    real = pair_key(["load=0.7", "mode=real", "policy=sjf"], {})
    assert sim == real == ("load=0.7", "policy=sjf")
    assert pair_key(["mode=sim", "policy=fcfs"], {}) != real
    # without kept overrides, what the run's metrics say it ran
    ran = {"policy": "fcfs", "trace": "synthetic", "mode": "sim"}
    assert pair_key(None, ran) == pair_key(None, {**ran, "mode": "real"})
    assert pair_key(None, ran) != pair_key(None, {**ran, "policy": "sjf"})


def test_each_simulation_pairs_with_the_one_real_run_of_its_setting():
    runs = [
        {"name": "s1", "mode": "sim", "setting": "a"},
        {"name": "r2", "mode": "real", "setting": "b"},
        {"name": "r1", "mode": "real", "setting": "a"},
        {"name": "s2", "mode": "sim", "setting": "b"},
        {"name": "s1-again", "mode": "sim", "setting": "a"},
        {"name": "s3", "mode": "sim", "setting": "c"},  # no real run: unpaired
        {"name": "s4", "mode": "sim", "setting": "d"},  # two real runs: unpaired
        {"name": "r4", "mode": "real", "setting": "d"},
        {"name": "r4-again", "mode": "real", "setting": "d"},
        {"name": "p", "mode": "profile", "setting": "a"},  # neither side
    ]
    pairs = pair_runs(runs, itemgetter("setting"), itemgetter("mode"))
    names = [(sim["name"], real["name"]) for sim, real in pairs]
    assert names == [("s1", "r1"), ("s1-again", "r1"), ("s2", "r2")]


def requests(ids, arrivals, e2e) -> pd.DataFrame:
    return pd.DataFrame({"request_id": ids, "arrival_s": arrivals, "e2e_s": e2e})


def test_requests_join_by_id_and_keep_those_both_runs_measured():
    sim = requests([0, 1, 2], [0.0, 0.5, 1.0], [1.0, 2.0, np.nan])  # 2 unfinished in sim
    real = requests([2, 0, 1], [1.0, 0.0, 0.5], [3.5, 1.5, 2.5])  # another row order
    both = join_requests(sim, real, "e2e_s", "the runs")
    assert both.index.tolist() == [0, 1]
    assert both["e2e_s_sim"].tolist() == [1.0, 2.0]
    assert both["e2e_s_real"].tolist() == [1.5, 2.5]


@pytest.mark.parametrize(
    "real",
    [
        requests([0, 1], [0.0, 0.6], [1.0, 1.0]),  # request 1 arrived later
        requests([0], [0.0], [1.0]),  # request 1 never arrived
    ],
)
def test_runs_of_other_arrivals_are_refused_by_name(real):
    sim = requests([0, 1], [0.0, 0.5], [1.0, 1.0])
    with pytest.raises(ValueError, match="sim/ and real/ did not replay the same arrivals"):
        join_requests(sim, real, "e2e_s", "sim/ and real/")
