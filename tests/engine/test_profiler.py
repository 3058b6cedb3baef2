"""The profiler end to end on the CPU (quick grid): the table the simulator fits."""

from __future__ import annotations

import pandas as pd
import pytest

from testbed.profiling.profiler import GRIDS
from testbed.sim.latency import ProfileModel, read_profile_header
from tests.sim.test_runs import compose_cfg, run_from_config


def test_profile_mode_writes_a_table_with_its_provenance_and_speed_probe(tmp_path):
    out = run_from_config(
        compose_cfg(
            "mode=profile",
            "mode.grid=quick",
            "mode.repeats=3",
            "mode.warmup=1",
            "mode.replay_requests=6",
            f"profiles_dir={tmp_path}",
        )
    )
    path = tmp_path / "cpu" / "dummy-llama.csv"
    assert out["profile"] == str(path)
    header = read_profile_header(path)
    for key in ("device", "date", "torch", "model", "dtype", "block_size", "measured_by"):
        assert header.get(key), key
    probe, before, after = (float(v.strip("(),")) for v in header["speed_probe_s"].split())
    assert probe == pytest.approx((before + after) / 2, rel=1e-4)
    assert 0 < before < 1 and 0 < after < 1
    table = pd.read_csv(path, comment="#")
    points = table[table["grid"] == "point"]
    assert len(points) == len(GRIDS["quick"])
    assert (points["latency_min_s"] <= points["latency_s"]).all()
    assert (points["latency_s"] <= points["latency_max_s"]).all()
    assert (table[table["grid"] == "replay"]["latency_s"] > 0).all()
    assert len(table[table["grid"] == "replay"]) > 6  # a step per chunk and decode
    # Decode steps cost more with more requests; the fit's own error is small.
    decodes = points[points["prefill_tokens"] == 0].sort_values("decode_batch")
    assert decodes["latency_s"].is_monotonic_increasing
    assert ProfileModel(path).fit_rel_error < 0.25
