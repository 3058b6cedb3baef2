"""The search's results on a synthetic search: the best per SLO, the Pareto
front, the knobs' effects (bounds that hold against the truth), and the files."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from testbed.search.report import (
    RESULTS,
    SearchRecord,
    front_rows,
    knob_effects,
    pareto,
    write_results,
)
from testbed.search.space import Space
from tests.search.helpers import SLOS, SMALL_SPACE, synthetic_search


def record_of(search) -> SearchRecord:
    space = Space.of(SMALL_SPACE)
    return SearchRecord(
        settings={"space": space, "budget": 8, "probes": 4},
        deployments=space.expand(),
        dropped={},
        starts={n: 1.0 for n in search.deps},
        latency_sources={},
        floors="on",
        trace="synthetic",
        num_requests=10,
        model="m",
        hardware="h",
    )


def test_the_front_holds_no_point_another_beats():
    search, model = synthetic_search(2)
    search.run(model.launch)
    front = pd.DataFrame(front_rows(search))
    for (slo, latency), points in front.groupby(["slo", "latency"]):
        met = [r for r in search.runs if r.met.get(slo)]
        key = f"{latency}_{next(s.percentile for s in SLOS if s.name == slo)}"
        assert len(points) >= 1 and len(met) >= len(points)
        for _, p in points.iterrows():
            beaten = [
                r for r in met
                if r.rate / search.deps[r.dep].gpus > p["rate_req_s_per_gpu"] + 1e-12
                and r.metrics[key] <= p[latency]
            ]  # fmt: skip
            assert not beaten, (slo, latency, p["config"])
        # its highest point is the best configuration's
        assert points["rate_req_s_per_gpu"].max() == search.best(slo)[0]
    assert pareto([], "ttft_s") == []


@pytest.mark.parametrize("bound", [True, False])
def test_the_knobs_effects_bound_what_the_other_values_truly_reach(bound):
    search, model = synthetic_search(3, bound=bound)
    search.run(model.launch)
    rows = knob_effects(search, record_of(search))
    assert {r["knob"] for r in rows} == {k for k, v in SMALL_SPACE.items() if len(v) > 1}
    verdicts = set()
    for row in rows:
        slo = next(s for s in SLOS if s.name == row["slo"])
        rate = search.best(slo.name)[0]
        others = [d for d in search.deps.values() if getattr(d, row["knob"]) == row["value"]]
        assert row["configurations"] == len(others) > 0
        truth = max(model.truth(d, slo) for d in others) / rate
        assert row["reach_at_least"] <= truth * (1 + 1e-9) <= row["reach_at_most"] * (1 + 1e-9)
        verdicts.add(row["verdict"])
    if not bound:  # every rate bracketed; the synthetic capacities differ by up to 4x
        assert "mattered" in verdicts


def test_the_results_are_written_and_agree_with_the_search(tmp_path):
    search, model = synthetic_search(4)
    search.run(model.launch)
    result = write_results(tmp_path, search, record_of(search))
    for name in RESULTS.values():
        assert (tmp_path / name).exists(), name
    saved = json.loads((tmp_path / "search.json").read_text())
    assert (
        saved["counts"]["simulations"]
        == len(search.runs)
        == len(pd.read_csv(tmp_path / "search_runs.csv"))
    )
    for best in saved["best"]:
        assert math.isclose(best["rate_req_s_per_gpu"], search.best(best["slo"])[0])
    configs = pd.read_csv(tmp_path / "search_configs.csv")
    assert len(configs) == len(search.deps) * len(SLOS)
    assert set(configs["status"]) <= {"converged", "pruned"}
    assert result["counts"]["pairs"] == configs["status"].value_counts().to_dict()
    page = (tmp_path / "search.html").read_text()
    assert page.count('class="plotly-graph-div"') == len(SLOS)
