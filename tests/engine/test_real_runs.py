"""mode=real through Hydra's compose API: the same run directory as the simulator."""

from __future__ import annotations

import json

import pandas as pd

from tests.sim.test_runs import compose_cfg, run_from_config

SHORT = ["trace.num_requests=8", "trace.rate=20", "logging=disabled", "progress=false"]


def test_real_run_writes_the_simulators_run_directory(tmp_path):
    real = run_from_config(compose_cfg("mode=real", *SHORT), tmp_path / "real")
    sim = run_from_config(compose_cfg("mode=sim", *SHORT), tmp_path / "sim")
    assert real["num_finished"] == 8 and real["latency_model"] == "measured"
    assert set(real) - {"tokens_computed"} == set(sim) - {
        "sim_wall_s",
        "sim_requests_per_wall_s",
        "num_jumps",
        "num_jumped_steps",
        "latency_scale",
    }
    for f in ("requests.csv", "steps.csv"):
        a, b = pd.read_csv(tmp_path / "real" / f), pd.read_csv(tmp_path / "sim" / f)
        assert list(a.columns) == list(b.columns)
    reqs = pd.read_csv(tmp_path / "real" / "requests.csv")
    # The same trace: the same requests, prompts and output lengths in both modes.
    sim_reqs = pd.read_csv(tmp_path / "sim" / "requests.csv")
    assert (
        (
            reqs[["request_id", "prompt_tokens", "output_tokens"]]
            == sim_reqs[["request_id", "prompt_tokens", "output_tokens"]]
        )
        .all()
        .all()
    )
    assert json.loads((tmp_path / "real" / "metrics.json").read_text())["mode"] == "real"


def test_real_run_stopped_early_is_partial(tmp_path):
    m = run_from_config(
        compose_cfg(
            "mode=real",
            "mode.max_wall_s=1.0",
            "trace.num_requests=30",
            "trace.rate=5",
            "logging=disabled",
            "progress=false",
        ),
        tmp_path,
    )
    assert m["partial"] is True and m["num_finished"] < 30
    assert len(pd.read_csv(tmp_path / "requests.csv")) == 30
