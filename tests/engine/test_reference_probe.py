"""The reference probe (hardware.reference_cpus): a loop on another core beside
real runs and profiles, read beside the busy engine only."""

from __future__ import annotations

import os

import numpy as np
import pandas as pd
import pytest

from testbed.job import run_from_config
from testbed.profile_table import read_profile_header
from testbed.profiling.reference_probe import (
    BUSY_COVER,
    ReferenceProbe,
    beside_busy,
    busy_cover,
    busy_median,
    sample_table,
)
from tests.sim.helpers import compose_cfg

CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
two_cores = pytest.mark.skipif(
    len(CORES) < 2, reason="the reference probe needs a second core (Linux affinity)"
)


def test_busy_cover_is_the_fraction_of_each_sample_beside_an_execution():
    busy = [(1.0, 2.0), (3.0, 3.5)]
    samples = np.array(
        [
            [1.8, 0.5],  # 1.3-1.8: inside the first
            [2.5, 1.0],  # 1.5-2.5: half
            [2.9, 0.3],  # 2.6-2.9: between
            [3.5, 1.5],  # 2.0-3.5: the second's 0.5 of 1.5
            [10.0, 0.1],  # after both
            [0.5, 0.2],  # before both
        ]
    )
    assert busy_cover(samples, busy) == pytest.approx([1.0, 0.5, 0.0, 1 / 3, 0.0, 0.0])
    assert busy_cover(samples, []) == pytest.approx(np.zeros(6))
    assert busy_cover(np.zeros((0, 2)), busy).shape == (0,)
    # On a run's clock: perf_counter times less the run's origin, busy on that clock.
    table = sample_table(samples + [100.0, 0.0], busy, origin=100.0)
    assert table["time_s"].tolist() == pytest.approx(samples[:, 0])
    assert table["busy"].tolist() == pytest.approx([1.0, 0.5, 0.0, 1 / 3, 0.0, 0.0])
    assert busy_median(table) == (pytest.approx(0.5), 1)  # only the first is beside a step
    assert busy_median(table.iloc[2:3]) == (pytest.approx(float("nan"), nan_ok=True), 0)


def test_the_reference_must_run_on_cores_the_engine_does_not_use():
    from testbed.engine.args import EngineArgs

    with pytest.raises(ValueError, match=r"overlaps hardware\.cpus"):
        ReferenceProbe(EngineArgs(model="dummy-llama", cpus=[0, 1]), None, [1])
    with pytest.raises(ValueError, match="at least one core"):
        ReferenceProbe(EngineArgs(model="dummy-llama"), None, [])


@two_cores
def test_a_real_run_records_the_reference_beside_its_busy_steps(tmp_path):
    engine_core, reference_core = CORES[-1], CORES[0]
    m = run_from_config(
        compose_cfg(
            "mode=real",
            f"hardware.cpus=[{engine_core}]",
            f"hardware.reference_cpus=[{reference_core}]",
            "hardware.threads=1",
            "trace.num_requests=8",
            "trace.rate=4",
            "logging=disabled",
            "progress=false",
            "plots=false",
        ),
        tmp_path,
    )
    assert m["num_finished"] == 8
    ref = pd.read_csv(tmp_path / "reference_probe.csv")
    steps = pd.read_csv(tmp_path / "steps.csv")
    assert len(ref) > 10 and (ref["probe_s"] > 0).all()
    assert ref["busy"].between(0, 1).all() and (ref["busy"] >= BUSY_COVER).any()
    # On the run's clock: the samples span the run (the loop runs throughout).
    end = (steps["start_s"] + steps["latency_s"]).max()
    assert ref["time_s"].min() < steps["start_s"].min() + 0.5
    assert ref["time_s"].max() > end - 0.5
    busy = beside_busy(ref)
    assert m["reference_probe_samples"] == len(busy)
    assert m["reference_probe_s"] == pytest.approx(busy["probe_s"].median(), rel=1e-4)
    # A sample marked busy lies (almost) wholly inside the run's steps.
    starts, ends = steps["start_s"].to_numpy(), (steps["start_s"] + steps["latency_s"]).to_numpy()
    for t, s in busy[["time_s", "probe_s"]].head(20).itertuples(index=False):
        overlap = np.clip(np.minimum(ends, t) - np.maximum(starts, t - s), 0, None).sum()
        assert overlap >= BUSY_COVER * s - 1e-4, (t, s, overlap)


@two_cores
def test_a_profile_records_the_reference_median_in_its_header(tmp_path):
    from testbed.engine.args import EngineArgs
    from testbed.profiling.profiler import run_profile

    path = run_profile(
        EngineArgs(model="dummy-llama", device="cpu", cpus=[CORES[-1]], threads=1),
        "quick",
        repeats=2,
        warmup=1,
        out_dir=tmp_path,
        hardware="cpu",
        replay_requests=4,
        max_grid_s=1e-9,  # one grid point, then the replay
        reference_cpus=[CORES[0]],
    )
    header = read_profile_header(path)
    median, *words = header["reference_probe_s"].split()
    # "<s> (median of <n> samples beside the busy engine, of <total>, on cores [c])"
    assert 0 < float(median) < 1
    n, total = int(words[2]), int(words[9].rstrip(","))
    assert 0 < n <= total
    assert header["reference_probe_s"].endswith(f"on cores [{CORES[0]}])")
    # Split by phase: the grid's samples (one short point here: maybe none beside
    # its steps) and the replay's; the closing speed probe's are in the whole only.
    assert "reference_probe_replay_s" in header
    phases = [
        header[k].split()
        for k in header
        if k.startswith("reference_probe_") and k != "reference_probe_s"
    ]
    assert all(0 < float(words[0]) < 1 for words in phases)
    assert 0 < sum(int(words[3]) for words in phases) <= n


def test_the_reference_header_splits_the_samples_by_phase():
    from types import SimpleNamespace

    import numpy as np

    from testbed.profiling.reference_probe import reference_header

    ends = np.arange(1.0, 31.0)  # grid before 10 s, replay 10-20 s, then the tail
    seconds = np.where(ends < 10, 0.01, np.where(ends < 20, 0.02, 0.05))
    probe = SimpleNamespace(samples=np.column_stack([ends, seconds]), busy=[(0.0, 40.0)], cpus=[0])
    header = reference_header(probe, 10.0, 20.0)
    assert header["reference_probe_grid_s"] == "0.01 (median of 9 samples)"
    assert header["reference_probe_replay_s"] == "0.02 (median of 10 samples)"
    assert header["reference_probe_s"].startswith("0.02 (median of 30 samples")
    # Stopped before its replay: every sample is the grid's, none the replay's.
    assert "reference_probe_replay_s" not in reference_header(probe)
