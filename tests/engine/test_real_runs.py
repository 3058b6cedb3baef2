"""mode=real through Hydra's compose API: the same run directory as the simulator."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pandas as pd
import pytest
import torch

from testbed.engine.device import machine_name
from testbed.job import run_from_config
from testbed.threads import default_threads
from tests.sim.helpers import compose_cfg, run_and_signal

ROOT = Path(__file__).resolve().parents[2]

SHORT = ["trace.num_requests=8", "trace.rate=20", "logging=disabled", "progress=false"]


def test_a_real_run_at_a_load_replays_what_the_simulator_would(tmp_path):
    """load= in real mode: the simulator's capacity for the run's hardware sets the
    rate, and the engine replays the very arrivals a simulation at that load does."""
    load = ["trace.num_requests=20", "load=0.9", "capacity_cache=null", "logging=disabled"]
    load.append("progress=false")
    real = run_from_config(compose_cfg("mode=real", *load), tmp_path / "real")
    sim = run_from_config(compose_cfg("mode=sim", *load), tmp_path / "sim")
    assert real["capacity_req_s"] == sim["capacity_req_s"] > 0
    assert real["rate_req_s"] == sim["rate_req_s"] == 0.9 * sim["capacity_req_s"]
    arrivals = [pd.read_csv(tmp_path / m / "requests.csv")["arrival_s"] for m in ("real", "sim")]
    assert arrivals[0].tolist() == pytest.approx(arrivals[1].tolist())
    assert real["num_finished"] == 20


def test_real_run_writes_the_simulators_run_directory(tmp_path):
    real = run_from_config(compose_cfg("mode=real", *SHORT), tmp_path / "real")
    sim = run_from_config(compose_cfg("mode=sim", *SHORT), tmp_path / "sim")
    assert real["num_finished"] == 8 and real["latency_model"] == "measured"
    assert real["machine"] == machine_name(torch.device("cpu"))  # what the run ran on
    assert real["attention_backend"].startswith("testbed.kernels.cpu_attention (")
    speed = {"speed_vs_profile", "speed_vs_profile_min", "speed_vs_profile_max", "speed_profile"}
    # What its CPU work ran on: one thread per core others leave free, at most torch's.
    threads = {"threads", "threads_fewest", "thread_changes", "interop_threads", "omp_wait_policy"}
    assert 1 <= real["threads_fewest"] <= real["threads"] == default_threads()
    assert real["omp_wait_policy"] == os.environ.get("OMP_WAIT_POLICY", "openmp default")
    only_real = {"tokens_computed", "machine", "attention_backend", *speed, *threads}
    assert set(real) - only_real == set(sim) - {
        "sim_wall_s",
        "sim_requests_per_wall_s",
        "num_jumps",
        "num_jumped_steps",
        "latency_scale",
        "speed_trace",
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


def test_a_real_run_says_how_fast_its_machine_ran_against_the_profile(tmp_path):
    """speed_vs_profile: the run's busy time over its hardware's profile's
    prediction of the steps it logged; no such keys without a profile."""
    from testbed.build import latency_model
    from testbed.sim.run_speed import predict_logged_steps

    cfg = compose_cfg("mode=real", *SHORT)
    model = latency_model(cfg)
    if model.kind != "profile":
        pytest.skip(f"no profile of {cfg.model.name} on {cfg.hardware.name} in {cfg.profiles_dir}")
    real = run_from_config(cfg, tmp_path / "real")
    steps = pd.read_csv(tmp_path / "real" / "steps.csv")
    busy = steps[steps["num_reqs"] > 0]
    measured = busy["latency_s"].sum() / predict_logged_steps(model, busy).sum()
    assert real["speed_vs_profile"] == pytest.approx(measured, rel=1e-6)
    if busy["start_s"].max() - busy["start_s"].min() < 60:  # one minute: no range
        assert real["speed_vs_profile_min"] == real["speed_vs_profile_max"]
        assert real["speed_vs_profile_max"] == pytest.approx(measured, rel=1e-6)
    assert real["speed_profile"] == model.source
    bare = compose_cfg("mode=real", *SHORT, f"profiles_dir={tmp_path / 'none'}")
    assert "speed_vs_profile" not in run_from_config(bare, tmp_path / "bare")
    # A profile that cannot be read costs the run nothing but this number.
    broken = tmp_path / "broken" / cfg.hardware.name
    broken.mkdir(parents=True)
    (broken / f"{cfg.model.name}.csv").write_text("kind,num_reqs\nstep,1\n")
    cfg = compose_cfg("mode=real", *SHORT, f"profiles_dir={tmp_path / 'broken'}")
    m = run_from_config(cfg, tmp_path / "run-broken")
    assert m["num_finished"] == 8 and "lacks columns" in m["speed_vs_profile_error"]
    assert (tmp_path / "run-broken" / "requests.csv").is_file()


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


def test_idle_probe_samples_only_between_steps_and_delays_no_arrival(tmp_path):
    """mode.idle_probe=true: the machine's speed is sampled while the engine waits
    for arrivals; no sample overlaps a step, and every step after a sample starts
    after it ended, so the run is what it would be without the probe."""
    m = run_from_config(
        compose_cfg(
            "mode=real",
            "mode.idle_probe=true",
            "trace.num_requests=6",
            "trace.rate=2",  # gaps of about half a second between requests
            "trace.output.mean=4",
            "logging=disabled",
            "progress=false",
            "plots=false",
        ),
        tmp_path,
    )
    assert m["num_finished"] == 6
    probe = pd.read_csv(tmp_path / "idle_probe.csv")
    steps = pd.read_csv(tmp_path / "steps.csv")
    assert m["idle_probe_samples"] == len(probe) >= 3
    assert m["idle_probe_s"] == pytest.approx(probe["probe_s"].median(), rel=1e-4)
    assert (probe["probe_s"] > 0).all() and probe["time_s"].is_monotonic_increasing
    starts = steps["start_s"].to_numpy()
    ends = starts + steps["latency_s"].to_numpy()
    for t, s in probe[["time_s", "probe_s"]].itertuples(index=False):
        assert not ((starts < t + s) & (ends > t)).any(), f"the sample at {t:.3f}s overlaps a step"
    # Arrivals are not delayed: every sample ended before the next request arrived.
    arrivals = pd.read_csv(tmp_path / "requests.csv")["arrival_s"].to_numpy()
    for t, s in probe[["time_s", "probe_s"]].itertuples(index=False):
        later = arrivals[arrivals > t]
        assert not len(later) or t + s <= later.min(), f"the sample at {t:.3f}s delayed an arrival"


@pytest.mark.slow
def test_a_real_run_stopped_by_sigterm_writes_what_it_measured(tmp_path):
    # timeout, kill and batch schedulers stop a process with SIGTERM: run.py ends the
    # run as on Ctrl-C, with its files written and marked partial, and exits with
    # 128 + SIGTERM as shells and batch schedulers expect.
    args = ["mode=real", "trace.num_requests=400", "trace.rate=4", "logging=disabled"]
    status, out, err = run_and_signal([*args, "plots=false"], signal.SIGTERM, tmp_path)
    assert status == 143, err[-2000:]
    assert "interrupted" in err
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["partial"] is True and metrics["stop_reason"] == "interrupted"
    assert 0 < metrics["num_finished"] < 400
    assert len(pd.read_csv(tmp_path / "requests.csv")) == 400  # unfinished ones too
    assert "run directory" in out


def test_a_finished_real_run_leaves_no_engine_alive(tmp_path, monkeypatch):
    """Runs in one process (the fidelity experiment's real runs) must each free
    their engine: on a GPU its weights and KV cache take most of the card, and the
    next run's build_engine (which collects garbage and empties torch's cache
    first) only gets that memory back if nothing still holds the last engine."""
    import gc
    import weakref

    from testbed.modes import real
    from testbed.profiling import probes

    built = []
    real_build = real.build_engine

    def build(*args, **kwargs):
        engine, executor, cfg = real_build(*args, **kwargs)
        built.append((weakref.ref(engine), weakref.ref(executor), weakref.ref(executor.model)))
        return engine, executor, cfg

    monkeypatch.setattr(real, "build_engine", build)
    monkeypatch.setattr(probes, "build_engine", build)
    for name in ("a", "b"):
        m = run_from_config(
            compose_cfg("mode=real", "mode.idle_probe=true", *SHORT), tmp_path / name
        )
        assert m["num_finished"] == 8
    gc.collect()
    assert len(built) >= 2  # each run's engine (and the idle probe's)
    alive = [i for i, refs in enumerate(built) for r in refs if r() is not None]
    assert not alive, f"engines still referenced after their runs: {alive}"


def test_a_real_runs_measured_acceptance_round_trips_through_a_simulation(tmp_path):
    """A real run with n-gram speculation on stories260K writes its acceptance
    table; a simulation of the same workload that reads it drafts and accepts at
    the same rates, within four standard errors of the two runs' counts."""
    import math

    from testbed.models import models_dir

    if not (models_dir() / "stories260K" / "hf" / "config.json").exists():
        pytest.skip(f"stories260K not found under {models_dir()} (set TESTBED_MODELS_DIR)")
    model = "model=tinystories-260k"
    spec = ["engine.speculative.method=ngram", "engine.speculative.num_speculative_tokens=3"]
    base = ["trace.num_requests=16", "trace.rate=8", "logging=disabled", "progress=false", model]
    real = run_from_config(compose_cfg("mode=real", *base, *spec), tmp_path / "real")
    table = tmp_path / "real" / "spec_acceptance.csv"
    assert real["spec_num_drafts"] > 0 and table.exists()
    steps = pd.read_csv(tmp_path / "real" / "steps.csv")
    assert steps.num_draft_tokens.sum() == real["spec_num_draft_tokens"]
    assert steps.num_accepted_tokens.sum() == real["spec_num_accepted_tokens"]
    sim = run_from_config(
        compose_cfg("mode=sim", *base, *spec, f"engine.speculative.acceptance_table={table}"),
        tmp_path / "sim",
    )
    assert sim["spec_acceptance_model"] == str(table)
    measured = pd.read_csv(table)
    simulated = pd.read_csv(tmp_path / "sim" / "spec_acceptance.csv")
    for (_, a), (_, b) in zip(measured.iterrows(), simulated.iterrows(), strict=True):
        for rate, n in (("proposal_rate", "offered"), ("acceptance_rate", "verified")):
            p = a[rate]
            if a[n] == 0 or b[n] == 0 or p in (0.0, 1.0):
                continue
            se = math.sqrt(p * (1 - p) * (1 / a[n] + 1 / b[n]))
            assert abs(b[rate] - p) < 4 * se, (rate, a.position, p, b[rate])
