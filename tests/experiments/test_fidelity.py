"""A small, tolerant sim-vs-real check: a change that breaks calibration shows here.

The committed CPU profile was measured on one 2-core machine; CI runs on another
of the same kind, so the bounds are loose (the full experiment's targets are 5%
and 10%: experiments/fidelity.py). A profile off by 2x, a latency model that
ignores the batch, or a simulator that stamps tokens wrongly fails it.
"""

from __future__ import annotations

import json

from experiments.fidelity import compare, step_errors
from testbed.runner import latency_model
from tests.sim.test_runs import compose_cfg, run_from_config

SHORT = [
    "trace.num_requests=40",
    "trace.rate=4",
    "logging=disabled",
    "progress=false",
    "plots=false",
]


def test_sim_predicts_the_real_engine_on_a_short_trace(tmp_path):
    for mode in ("sim", "real"):
        run_from_config(compose_cfg(f"mode={mode}", *SHORT), tmp_path / mode)
    sim = json.loads((tmp_path / "sim" / "metrics.json").read_text())
    assert sim["latency_model"] == "profile"  # the committed CPU profile is in use
    err = compare(tmp_path / "sim", tmp_path / "real")
    assert abs(err["err_throughput_req_s"]) < 0.15, err
    assert abs(err["err_tpot_s_mean"]) < 0.35, err
    assert abs(err["err_e2e_s_mean"]) < 0.35, err
    assert err["e2e_corr"] > 0.9, err
    # The latency model on the real run's own steps, apart from the schedule.
    steps = step_errors(tmp_path / "real", latency_model(compose_cfg("mode=sim", *SHORT)))
    assert abs(steps["step_err_total"]) < 0.35, steps
    assert set(steps) >= {"step_err_median", "step_err_decode_total"}, steps
