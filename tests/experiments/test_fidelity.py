"""A small, tolerant sim-vs-real check: a change that breaks calibration shows here.

The check profiles the machine it runs on first (the profiler's quick grid, on
one thread: ``hardware=cpu1``), as a user does before simulating, and replays a
short trace at 70% of the capacity that profile gives: CI machines are of one
kind but not of one speed (two of them 2x apart), and a profile of another
machine would measure the machine, not the simulator. A latency model that
ignores the batch, a profiler that times steps wrongly, or a simulator that
stamps tokens wrongly fails it.
One short run drifts with the machine (a shared VM: several percent within
minutes), so the bounds are loose (the full experiment's targets are 5% and
10%: experiments.fidelity), and the simulator is held tighter at the run's
own speed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from experiments.fidelity import cli
from experiments.fidelity.compare import (
    EFFECTS,
    PairRuns,
    machine_mismatches,
    pair_errors,
    policy_effects,
    prefixed_errors,
    size_bucket,
    size_label,
    step_errors,
    steps_by_size,
)
from experiments.fidelity.execute import run_isolated, simulate
from experiments.fidelity.plan import capacity, rounds
from experiments.fidelity.report import effects_markdown
from experiments.fidelity.speeds import (
    TRACE_WINDOW_S,
    busy_steps,
    neighbour_speeds,
    own_speed,
    reference_speed_trace,
    run_speed_trace,
    speed_summary,
    window_speeds,
    windows,
)
from testbed.build import latency_model
from testbed.job import run_from_config
from testbed.profile_table import read_profile_header, write_profile
from testbed.sim.speed import SpeedTrace
from tests.sim.helpers import ROOT, compose_cfg

CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []

SHORT = [
    "hardware=cpu1",
    "trace.num_requests=40",
    "logging=disabled",
    "progress=false",
    "plots=false",
]
QUICK_PROFILE = [
    "mode.grid=quick",
    "mode.repeats=3",
    "mode.warmup=1",
    "mode.replay_requests=20",
    "mode.replay_sparse_requests=0",
]


def test_the_committed_profile_is_the_simulators_default():
    model = latency_model(compose_cfg("mode=sim", *SHORT))
    assert model.path == ROOT / "profiles" / "cpu1" / "dummy-llama.csv"
    assert model.header["measured_by"].startswith("testbed.profiling")


def within(ratio: float, factor: float) -> bool:
    """``ratio`` (sim / real) within a factor of ``factor`` either way."""
    return 1 / factor < ratio < factor


def test_sim_predicts_the_real_engine_on_a_short_trace(tmp_path):
    profiles = tmp_path / "profiles"
    run_from_config(compose_cfg("mode=profile", *QUICK_PROFILE, *SHORT, f"profiles_dir={profiles}"))
    here = [*SHORT, f"profiles_dir={profiles}"]
    rate = round(0.7 * capacity(here), 4)
    here.append(f"trace.rate={rate}")
    run_from_config(compose_cfg("mode=sim", *here), tmp_path / "sim")
    run_from_config(compose_cfg("mode=real", "mode.idle_probe=true", *here), tmp_path / "real")
    sim = json.loads((tmp_path / "sim" / "metrics.json").read_text())
    assert sim["latency_model"] == "profile"  # this machine's profile is in use
    model = latency_model(compose_cfg("mode=sim", *here))
    assert model.path == profiles / "cpu1" / "dummy-llama.csv"
    err = pair_errors(tmp_path / "sim", tmp_path / "real")
    assert abs(err["err_throughput_req_s"]) < 0.15, (rate, err)
    assert err["e2e_corr"] > 0.9, (rate, err)
    # The latency model on the real run's own steps, apart from the schedule: a
    # profile off by 2x (a profiler that times half a step) fails here.
    steps = step_errors(busy_steps(tmp_path / "real", model))
    assert within(1 + steps["step_err_total"], 1.5), steps
    # Mean TPOT and E2E at the profile's speed hold only where the run kept that
    # speed: a VM 30% slower a minute after its quick profile replays the 70% load
    # at 91% of its capacity, where queueing doubles them (a CI run measured 2.1x).
    # Within 15% of it they stay within a factor of 2; the simulator itself is held
    # tighter at the run's own speed below, whatever the machine did.
    if within(1 + steps["step_err_total"], 1.15):
        assert within(1 + err["err_tpot_s_mean"], 2.0), (rate, err, steps)
        assert within(1 + err["err_e2e_s_mean"], 2.0), (rate, err, steps)
    else:
        warnings.warn(
            f"the run's steps took {1 / (1 + steps['step_err_total']):.2f}x the profile's: "
            "mean TPOT and E2E at the profile's speed not checked, only at the run's own",
            stacklevel=1,
        )
    assert set(steps) >= {"step_err_median", "step_err_decode_total"}, steps
    assert within(1 + steps["step_err_per_request"], 1.5), steps
    # At the run's own speed: the simulator (schedule, batching, the relative cost
    # of steps) apart from the machine's speed.
    own_sim = simulate(here, tmp_path / "own", own_speed(steps))
    own = prefixed_errors(own_sim, tmp_path / "real", "own")
    assert abs(own["own_err_tpot_s_mean"]) < 0.2, own
    assert abs(own["own_err_e2e_s_mean"]) < 0.2, own
    # The idle probe sampled between requests (not from the run's steps), against
    # the same probe in the profile: on one machine minutes apart their ratio is
    # near 1, but a shared VM's speed moves by up to 40% within minutes (a CI run
    # measured 0.64), so only a probe or a reference off by 2x fails. (A simulation
    # scaled by it carries the quick profile's own error, which the bounds above
    # already take.)
    reference = float(model.header["idle_probe_s"].split()[0])
    real = json.loads((tmp_path / "real" / "metrics.json").read_text())
    assert real["idle_probe_samples"] >= 1, real  # this short trace leaves a few gaps
    factor = real["idle_probe_s"] / reference
    assert within(factor, 2.0), (factor, real["idle_probe_s"], reference)


def experiment(out: Path, runs: Path, *args: str) -> pd.DataFrame:
    """The experiment on 12 synthetic requests, fcfs alone: its ``fidelity.csv``."""
    argv = ["--policies", "fcfs", "--traces", "synthetic", "--num-requests", "12"]
    cli.main([*argv, "--wandb", "disabled", "--out", str(out), "--runs", str(runs), *args])
    return pd.read_csv(out / "fidelity.csv")


@pytest.fixture(scope="module")
def twice(tmp_path_factory) -> SimpleNamespace:
    """One experiment with two real runs of fcfs (``--repeats 2``): its tables'
    folder, its runs folder, its table and the two runs' mean TPOT."""
    tmp = tmp_path_factory.mktemp("twice")
    table = experiment(tmp / "out", tmp / "runs", "--repeats", "2")
    (runs,) = (tmp / "runs").iterdir()
    reals = [runs / "synthetic" / name for name in ("fcfs-real", "fcfs-real-2")]
    tpot = [json.loads((r / "metrics.json").read_text())["tpot_s_mean"] for r in reals]
    return SimpleNamespace(out=tmp / "out", runs=runs, reals=reals, table=table, tpot=tpot)


def test_repeated_runs_are_compared_by_their_mean_and_each_alone(twice):
    assert list(twice.table["policy"]) == ["fcfs (real vs real)", "fcfs"]
    fcfs, tpot, runs = twice.table.iloc[1], twice.tpot, twice.runs
    # Compared with the mean of two real runs, which lies between the two.
    assert fcfs["real_runs"] == 2
    assert fcfs["real_tpot_s_mean"] == pytest.approx(sum(tpot) / 2, rel=1e-5)
    assert fcfs["real_spread_tpot_s_mean"] == pytest.approx(
        abs(tpot[0] - tpot[1]) / fcfs["real_tpot_s_mean"], rel=1e-4
    )
    assert fcfs["err_min_tpot_s_mean"] <= fcfs["err_tpot_s_mean"] <= fcfs["err_max_tpot_s_mean"]
    # Whether the policy had anything to order: the real steps with a request waiting.
    steps = pd.concat(pd.read_csv(r / "steps.csv") for r in twice.reals)
    assert fcfs["real_queued_steps"] == pytest.approx((steps["num_waiting"] > 0).mean(), rel=1e-5)
    # At the runs' own speed the simulation is scaled by exactly the busy-time ratio.
    assert fcfs["own_speed_factor"] == pytest.approx(1 / (1 + fcfs["step_err_total"]), rel=1e-5)
    assert abs(fcfs["own_err_throughput_req_s"]) < 0.2
    # And each run alone at its own speed, against that run.
    own = [runs / "synthetic" / f"fcfs-sim-own-speed-{k}" for k in (1, 2)]
    own_tpot = [json.loads((d / "metrics.json").read_text())["tpot_s_mean"] for d in own]
    each = sorted(o / r - 1 for o, r in zip(own_tpot, tpot, strict=True))
    assert [fcfs["own_each_err_min_tpot_s_mean"], fcfs["own_each_err_max_tpot_s_mean"]] == [
        pytest.approx(e, rel=1e-4, abs=1e-6) for e in each
    ]
    # And each run at its speed window by window: its speed trace is its windows'.
    model = latency_model(compose_cfg("mode=sim"))
    for k, real in enumerate(twice.reals, start=1):
        sim = runs / "synthetic" / f"fcfs-sim-run-speed-{k}"
        trace = SpeedTrace.from_csv(sim.with_suffix(".csv"))
        win = windows(busy_steps(real, model), TRACE_WINDOW_S)
        assert [trace.speeds[i] for i in win.index] == pytest.approx(win.tolist(), rel=1e-5)
        assert "fcfs-sim-run-speed" in json.loads((sim / "metrics.json").read_text())["speed_trace"]
    assert abs(fcfs["win_err_throughput_req_s"]) < 0.2 and abs(fcfs["win_err_tpot_s_mean"]) < 0.3


def test_the_tables_record_the_profile_its_fit_and_the_steps_by_batch(twice):
    fcfs = twice.table.iloc[1]
    # The latency model's fit to its profile (the committed one of this hardware).
    meta = json.loads((twice.out / "fidelity.json").read_text())["meta"]
    committed = latency_model(compose_cfg("mode=sim"))
    assert meta["profile_fit_rel_error"] == pytest.approx(committed.fit_rel_error)
    assert meta["simulated_with"] == [committed.source]
    # The manifest beside the tables: the commit, the command, the profile's digest.
    manifest = json.loads((twice.out / "manifest.json").read_text())
    digest = hashlib.sha1(committed.path.read_bytes()).hexdigest()
    shown = committed.path.resolve().relative_to(ROOT).as_posix()  # no machine's folders
    assert manifest["profile_sha1"] == {shown: digest}
    assert {"git_sha", "command", "host", "date"} <= set(manifest)
    markdown = (twice.out / "fidelity.md").read_text()
    table = next(b for b in markdown.split("\n\n") if b.startswith("|")).splitlines()
    assert len(table) == 2 + len(twice.table) and table[3].startswith("| synthetic | fcfs |")
    # The latency model on both runs' steps by batch: shares of the busy time that
    # add up, and errors that add up to the pair's over all steps.
    sizes = pd.read_csv(twice.out / "steps_by_size.csv")
    assert set(sizes["step"]) <= {"decode only", "with prefill"} and len(sizes) > 2
    assert sizes["busy_share"].sum() == pytest.approx(1, rel=1e-4)
    level = (sizes["busy_share"] * (1 + sizes["err"])).sum()
    assert level == pytest.approx(1 + fcfs["step_err_total"], rel=1e-4)
    assert "## The latency model on the real steps, by batch" in markdown


def test_reused_runs_give_the_same_tables_and_nothing_real_runs_again(twice, tmp_path, capsys):
    capsys.readouterr()
    again = experiment(
        tmp_path / "out", tmp_path / "runs", "--repeats", "2", "--reuse", str(twice.runs)
    )
    assert "WARNING --reuse" not in capsys.readouterr().out  # the same profile
    (runs,) = (tmp_path / "runs").iterdir()
    assert not [p for p in runs.glob("*/*-real*") if not p.name.endswith("-mean")]
    pd.testing.assert_frame_equal(twice.table, again)
    # Without --out, the tables go beside the runs (under outputs/fidelity by default).
    argv = ["--policies", "fcfs", "--traces", "synthetic", "--num-requests", "12"]
    cli.main(
        [
            *argv,
            "--wandb",
            "disabled",
            "--runs",
            str(tmp_path / "beside"),
            "--reuse",
            str(twice.runs),
        ]
    )
    (beside,) = (tmp_path / "beside").iterdir()
    assert {"fidelity.csv", "fidelity.md", "manifest.json"} <= {p.name for p in beside.iterdir()}
    assert cli.parser().get_default("runs") == str(ROOT / "outputs" / "fidelity")


def test_a_second_run_is_the_noise_floor_and_an_unfinished_run_is_left_out(twice, tmp_path):
    # One repeat and --noise: the first run alone, the second as the noise floor.
    noise = experiment(tmp_path / "out", tmp_path / "runs", "--noise", "--reuse", str(twice.runs))
    assert noise.iloc[0]["err_tpot_s_mean"] == twice.table.iloc[0]["err_tpot_s_mean"]
    assert "real_runs" not in noise.columns
    assert noise.iloc[1]["real_tpot_s_mean"] == pytest.approx(twice.tpot[0], rel=1e-5)
    # A real run that did not finish (interrupted: partial) is left out, and what
    # finished is still compared.
    cut = tmp_path / "cut"
    shutil.copytree(twice.runs, cut)
    metrics = cut / "synthetic" / "fcfs-real-2" / "metrics.json"
    metrics.write_text(json.dumps(dict(json.loads(metrics.read_text()), partial=True)))
    partial = experiment(
        tmp_path / "out", tmp_path / "runs2", "--repeats", "2", "--reuse", str(cut)
    )
    assert list(partial["policy"]) == ["fcfs"] and "real_runs" not in partial.columns
    assert partial.iloc[0]["real_tpot_s_mean"] == pytest.approx(twice.tpot[0], rel=1e-5)


def test_each_profiler_pass_is_simulated_alone_and_another_profile_is_named(
    twice, tmp_path, capsys
):
    # Profiler passes at two speeds: one simulation per pass, their metrics averaged.
    runs = tmp_path / "reused"
    shutil.copytree(twice.runs, runs)
    committed = ROOT / "profiles" / "cpu" / "dummy-llama.csv"
    table = pd.read_csv(committed, comment="#")
    for k, speed in ((1, 1.0), (2, 1.3)):
        path = runs / "profile-passes" / str(k) / "cpu" / "dummy-llama.csv"
        slower = table.assign(latency_s=table["latency_s"] * speed)
        write_profile(path, read_profile_header(committed), slower)
    passes = experiment(tmp_path / "out", tmp_path / "runs", "--reuse", str(runs)).iloc[0]
    (new,) = (tmp_path / "runs").iterdir()
    sims = [new / "synthetic" / f"fcfs-sim-pass{k}" / "metrics.json" for k in (1, 2)]
    tpot = [json.loads(p.read_text())["tpot_s_mean"] for p in sims]
    assert tpot[1] > 1.2 * tpot[0]
    # As ratios: an error near zero, from a CSV's 6 digits, has no relative precision.
    expected = (tpot[0] + tpot[1]) / 2 / passes["real_tpot_s_mean"]
    assert 1 + passes["pass_err_tpot_s_mean"] == pytest.approx(expected, rel=1e-5)
    # Re-simulated with another profile of the same header (measured again, or
    # edited): said so, since the tables then differ for the model, not the runs.
    other = tmp_path / "other-profiles" / "cpu" / "dummy-llama.csv"
    write_profile(
        other, read_profile_header(committed), table.assign(latency_s=table["latency_s"] * 1.3)
    )
    capsys.readouterr()
    experiment(
        tmp_path / "out",
        tmp_path / "runs2",
        "--reuse",
        str(twice.runs),
        "--extra",
        f"profiles_dir={other.parents[1]}",
    )
    warned = capsys.readouterr().out
    assert f"WARNING --reuse: {twice.runs / 'synthetic' / 'fcfs-sim'} was simulated with" in warned


def write_probe_profile(profiles: Path, header: dict) -> None:
    """The committed CPU profile's rows under ``profiles`` with ``header``."""
    committed = ROOT / "profiles" / "cpu" / "dummy-llama.csv"
    write_profile(profiles / "cpu" / "dummy-llama.csv", header, pd.read_csv(committed, comment="#"))


def run_with_probe(tmp_path, key: str, value: str, extra: list):
    """The experiment on 12 synthetic requests (fcfs), the committed profile's header
    recording the probe ``key`` as ``value``: (its fidelity.csv row, its runs
    folder, its arguments, the header)."""
    header = read_profile_header(ROOT / "profiles" / "cpu" / "dummy-llama.csv")
    header[key] = value
    profiles = tmp_path / "profiles"
    write_probe_profile(profiles, header)
    argv = ["--policies", "fcfs", "--traces", "synthetic", "--num-requests", "12"]
    argv += ["--wandb", "disabled", "--out", str(tmp_path / "out")]
    argv += ["--runs", str(tmp_path / "runs"), "--extra", f"profiles_dir={profiles}", *extra]
    cli.main(argv)
    (runs,) = (tmp_path / "runs").iterdir()
    return pd.read_csv(tmp_path / "out" / "fidelity.csv").iloc[0], runs, argv, header


def test_a_reference_probes_speed_trace_uses_busy_samples_and_fills_gaps(tmp_path):

    run = tmp_path / "run"
    run.mkdir()
    pd.DataFrame(
        dict(
            time_s=[12.0, 13.0, 14.0, 15.0, 31.0, 35.0],
            probe_s=[0.022, 0.024, 0.030, 0.018, 0.019, 0.021],
            busy=[1.0, 1.0, 0.2, 1.0, 0.95, 1.0],  # the 0.030 sample is left out
        )
    ).to_csv(run / "reference_probe.csv", index=False)
    (run / "metrics.json").write_text(json.dumps({"reference_probe_s": 0.021}))
    trace = reference_speed_trace(run, profiled=0.02, width_s=10.0)
    # 10-20 s: median of 0.022, 0.024, 0.018; 0-10 s: the run's median (0.021).
    assert trace.starts == [0.0, 10.0, 20.0, 30.0]
    assert trace.speeds == pytest.approx([1.05, 1.1, 1.1, 1.0])
    pd.DataFrame(dict(time_s=[1.0], probe_s=[0.02], busy=[0.5])).to_csv(
        run / "reference_probe.csv", index=False
    )
    assert reference_speed_trace(run, profiled=0.02) is None  # nothing beside a busy engine


@pytest.mark.skipif(
    len(CORES) < 2, reason="the reference probe needs a second core (Linux affinity)"
)
def test_fidelity_script_scales_the_simulation_by_the_reference_probe(tmp_path):
    """hardware.reference_cpus: the real run records a loop on another core beside
    its busy steps; the pair is also simulated with every step scaled by that
    loop's median over the profile's, and by its windows (a profile that records
    no reference is refused with its name)."""
    profiled = 0.02  # seconds: the profile's reference probe, as if measured so
    machine = [f"hardware.cpus=[{CORES[-1]}]", f"hardware.reference_cpus=[{CORES[0]}]"]
    row, runs, argv, header = run_with_probe(
        tmp_path,
        "reference_probe_s",
        f"{profiled} (median of 10 samples beside the busy engine)",
        [*machine, "trace.rate=3", "hardware.threads=1"],
    )
    real = json.loads((runs / "synthetic" / "fcfs-real" / "metrics.json").read_text())
    assert real["reference_probe_samples"] > 0
    factor = real["reference_probe_s"] / profiled
    assert row["reference_speed_factor"] == pytest.approx(factor, rel=1e-5)
    scaled = json.loads((runs / "synthetic" / "fcfs-sim-reference" / "metrics.json").read_text())
    assert scaled["latency_scale"] == pytest.approx(factor, rel=1e-5)
    by_window = runs / "synthetic" / "fcfs-sim-reference-windows-1.csv"
    assert SpeedTrace.from_csv(by_window).speeds  # the run's windows, as a speed trace
    assert {"ref_err_e2e_s_mean", "refwin_err_e2e_s_mean"} <= set(row.index)
    # run_speeds.csv: the reference's factor beside the run's own speed.
    speeds = pd.read_csv(tmp_path / "out" / "run_speeds.csv").iloc[0]
    assert speeds["reference_speed"] == pytest.approx(factor, rel=1e-5)
    assert speeds["reference_window_rms"] >= 0
    assert "reference / own speed - 1" in (tmp_path / "out" / "fidelity.md").read_text()
    meta = json.loads((tmp_path / "out" / "fidelity.json").read_text())["meta"]
    assert meta["profile_reference"] == ["reference_probe_s"]  # no replay median: the whole
    del header["reference_probe_s"]
    write_probe_profile(tmp_path / "profiles", header)
    with pytest.raises(SystemExit, match="records no reference_probe_s"):
        cli.main([*argv, "--reuse", str(runs)])


def test_policy_effects_compare_what_sim_and_real_say_about_the_policies(tmp_path):

    def run(name: str, e2e: float, high: float = 1.0) -> Path:
        """A run with mean E2E ``e2e``; the priority-0 requests' TTFT ``high``."""
        d = tmp_path / name
        d.mkdir()
        metrics = {key: 1.0 for key in EFFECTS}
        (d / "metrics.json").write_text(json.dumps(dict(metrics, e2e_s_mean=e2e)))
        reqs = pd.DataFrame(
            dict(ttft_s=[high, high, 2.0, 4.0], priority=[0, 0, 1, 1], tenant=["t0"] * 4)
        )
        reqs.to_csv(d / "requests.csv", index=False)
        return d

    # Simulation: sjf 20% faster than fcfs, vtc 10% slower. Real runs (two rounds):
    # sjf 10% and 30% faster (mean of 9 and 7 against 10), vtc 5% faster.
    pairs = {
        "fcfs": PairRuns(run("fcfs-sim", 10.0), [run("fcfs-r1", 10.0), run("fcfs-r2", 10.0)]),
        "sjf": PairRuns(run("sjf-sim", 8.0), [run("sjf-r1", 9.0), run("sjf-r2", 7.0)]),
        "vtc": PairRuns(run("vtc-sim", 11.0), [run("vtc-r1", 9.5), run("vtc-r2", 9.5)]),
        "priority": PairRuns(
            run("p-sim", 10.0, 0.5), [run("p-r1", 10.0, 0.6), run("p-r2", 10.0, 0.8)]
        ),
    }
    effects, orders = policy_effects({"t": pairs, "no-baseline": {"sjf": pairs["sjf"]}}, "fcfs")
    e2e = effects[effects["metric"] == "e2e_s_mean"].set_index("policy")
    assert set(effects["trace"]) == {"t"} and list(e2e.index) == ["sjf", "vtc", "priority"]
    # Per priority class (one tenant only: no per-tenant rows): the high class's
    # TTFT halved in simulation, 30% lower in the real runs; the low class as is.
    assert set(effects["metric"]) == {
        *EFFECTS,
        "ttft_s_mean[priority=0]",
        "ttft_s_mean[priority=1]",
    }
    high = effects[effects["metric"] == "ttft_s_mean[priority=0]"].set_index("policy")
    assert high.loc["priority", "sim_effect"] == pytest.approx(-0.5)
    assert high.loc["priority", "real_effect"] == pytest.approx(-0.3)
    low = effects[effects["metric"] == "ttft_s_mean[priority=1]"].set_index("policy")
    assert low.loc["priority", ["sim_effect", "real_effect"]].tolist() == [0.0, 0.0]
    assert e2e.loc["sjf", "sim_effect"] == pytest.approx(-0.2)
    assert e2e.loc["sjf", "real_effect"] == pytest.approx(-0.2)
    assert (e2e.loc["sjf", "real_effect_min"], e2e.loc["sjf", "real_effect_max"]) == (
        pytest.approx(-0.3),
        pytest.approx(-0.1),
    )
    assert e2e.loc["vtc", "sim_effect"] == pytest.approx(0.1)
    assert e2e.loc["vtc", "real_effect"] == pytest.approx(-0.05)
    order = orders[orders["metric"] == "e2e_s_mean"].iloc[0]
    assert order["real_order"] == "sjf < vtc < fcfs < priority"
    # sjf below the rest in both; fcfs = priority in both; vtc the other way round
    # against both of them.
    assert order["sim_order"] == "sjf < fcfs < priority < vtc"
    assert (order["pairs_ordered_alike"], order["pairs"]) == (4, 6)
    md = effects_markdown(effects, orders)
    assert "| t | e2e_s_mean | vtc | +10.0% | -5.0% | -5.0% .. -5.0% |" in md
    assert "own_effect_min" not in effects.columns  # no run simulated at its own speed
    # Each run also simulated at its own speed: the effects round by round beside
    # the real ones, and the largest gap in a round. sjf's own-speed simulations
    # give -15% and -25% against fcfs's (rounds: -10% and -30%).
    pairs["fcfs"].own[:] = [run("fcfs-o1", 10.0), run("fcfs-o2", 10.0)]
    pairs["sjf"].own[:] = [run("sjf-o1", 8.5), run("sjf-o2", 7.5)]
    effects, _ = policy_effects({"t": pairs}, "fcfs")
    sjf = effects[effects["metric"] == "e2e_s_mean"].set_index("policy").loc["sjf"]
    assert (sjf["own_effect_min"], sjf["own_effect_max"]) == (
        pytest.approx(-0.25),
        pytest.approx(-0.15),
    )
    assert sjf["own_round_gap"] == pytest.approx(0.05)
    vtc = effects[effects["metric"] == "e2e_s_mean"].set_index("policy").loc["vtc"]
    assert pd.isna(vtc["own_effect_min"])  # vtc's runs were not
    md = effects_markdown(effects, orders)
    assert (
        "| t | e2e_s_mean | sjf | -20.0% | -20.0% | -30.0% .. -10.0% | -25.0% .. -15.0% | 5.0% |"
        in md
    )
    assert (
        "| t | e2e_s_mean | sjf < fcfs < priority < vtc | sjf < vtc < fcfs < priority | 4 / 6 |"
        in md
    )
    assert "win_effect" not in effects.columns  # no pair simulated at its runs' speed
    # At the runs' speed window by window: with one pair left out, nothing; with
    # all four, each effect and the order it gives (vtc now below fcfs, as real).
    for name, e2e in (("fcfs", 10.0), ("sjf", 8.0), ("vtc", 9.0)):
        pairs[name].by_window = run(f"{name}-win", e2e)
    assert "win_effect" not in policy_effects({"t": pairs}, "fcfs")[0].columns
    pairs["priority"].by_window = run("p-win", 10.5)
    effects, orders = policy_effects({"t": pairs}, "fcfs")
    win = effects[effects["metric"] == "e2e_s_mean"].set_index("policy")["win_effect"]
    assert win.tolist() == pytest.approx([-0.2, -0.1, 0.05])
    order = orders[orders["metric"] == "e2e_s_mean"].iloc[0]
    assert (order["pairs_ordered_alike"], order["win_pairs_ordered_alike"]) == (4, 5)
    md = effects_markdown(effects, orders)
    assert "| t | e2e_s_mean | vtc | +10.0% | -10.0% | -5.0% | -5.0% .. -5.0% |" in md
    assert "| sjf < vtc < fcfs < priority | 4 / 6 | 5 / 6 |" in md


def test_steps_by_size_groups_the_real_steps_and_divides_out_the_machine(tmp_path):
    """Made-up runs and a model that predicts 3-request decodes 50% slow and
    everything else 10% fast: the per-size errors, their shares and the error
    beside the trace's overall one."""

    class Model:
        def predict_many(self, num_reqs, num_tokens, attn_pairs, kv_tokens, max_kv):
            three = (num_reqs == 3) & (num_tokens == 3)
            return np.where(three, 1.5, 0.9) * kv_tokens * 1e-6

    def step(reqs, prefill=0, decode=None, work=1e4, latency=1e-2):
        decode = reqs if decode is None else decode
        return dict(
            num_reqs=reqs,
            num_prefill_tokens=prefill,
            num_decode_tokens=decode,
            attn_pairs=work,
            kv_tokens=work,
            max_kv=work / 10,
            latency_s=latency,
        )

    for run, sizes in (("a", (1, 3, 3, 40)), ("b", (3, 8, 70))):
        rows = [step(n) for n in sizes]
        rows.append(step(3, prefill=64, decode=2))
        rows.append(step(0, work=0, latency=0.0))  # idle
        (tmp_path / run).mkdir()
        steps = pd.DataFrame(rows)
        steps["start_s"] = steps["latency_s"].cumsum().shift(fill_value=0.0)  # back to back
        steps.to_csv(tmp_path / run / "steps.csv", index=False)
    table = steps_by_size({"t": [busy_steps(tmp_path / r, Model()) for r in ("a", "b")]})
    by = {(r.step, r.num_reqs): r for r in table.itertuples()}
    assert set(by) == {
        ("decode only", "1"),
        ("decode only", "3"),
        ("decode only", "8"),
        ("decode only", "33-64"),
        ("decode only", "65-128"),
        ("with prefill", "3"),
    }
    assert by[("decode only", "3")].steps == 3 and by[("decode only", "3")].busy_share == 3 / 9
    assert by[("decode only", "3")].err == pytest.approx(0.5)
    assert by[("with prefill", "3")].err == pytest.approx(-0.1)
    level = (3 * 1.5 + 6 * 0.9) / 9
    assert by[("decode only", "8")].err_vs_trace == pytest.approx(0.9 / level - 1)
    assert [size_bucket(n) for n in (16, 17, 32, 33, 64, 65)] == [16, 32, 32, 64, 64, 128]
    assert [size_label(b) for b in (16, 32, 64)] == ["16", "17-32", "33-64"]


def test_neighbour_speeds_average_the_nearest_runs_of_the_trace_and_other_policies():

    ran = [("a", "vtc"), ("a", "fcfs"), ("b", "sjf"), ("a", "sjf"), ("a", "fcfs"), ("a", "vtc")]
    speeds = [1.0, 2.0, 100.0, 4.0, 8.0, 16.0]
    near = neighbour_speeds(ran, speeds, width=2)
    # fcfs (1): vtc before it; sjf and vtc after it (its own fcfs run and trace b's left out).
    assert near[1] == pytest.approx((1 + 4 + 16) / 3)
    # sjf (3): the two nearest on each side, of trace a and not sjf.
    assert near[3] == pytest.approx((1 + 2 + 8 + 16) / 4)
    # vtc (5), the last: only the two before it.
    assert near[5] == pytest.approx((4 + 8) / 2)
    assert neighbour_speeds(ran, speeds, width=1)[3] == pytest.approx((2 + 8) / 2)
    # Trace b has no other run: nothing to calibrate on.
    assert np.isnan(near[2])


def test_fidelity_script_simulates_each_pair_at_its_neighbours_speed(tmp_path):
    """Each pair is also simulated at the mean own speed of the other policies'
    runs around its own (up to two on each side, the pair's own runs left out)."""
    argv = ["--policies", "fcfs", "sjf", "priority", "--traces", "synthetic"]
    argv += ["--num-requests", "12", "--wandb", "disabled", "--out", str(tmp_path / "out")]
    argv += ["--in-process"]  # the runs in this process (the others: each in its own)
    cli.main([*argv, "--runs", str(tmp_path / "runs")])
    table = pd.read_csv(tmp_path / "out" / "fidelity.csv").set_index("policy")
    (runs,) = (tmp_path / "runs").iterdir()
    order = ["fcfs-real", "sjf-real", "priority-real"]
    model = latency_model(compose_cfg("trace=synthetic", "mode=sim"))
    own = {
        name: own_speed(step_errors(busy_steps(runs / "synthetic" / name, model))) for name in order
    }
    for name in order:  # each pair is its one run, at its own speed
        policy = name.removesuffix("-real")
        assert table.loc[policy, "own_speed_factor"] == pytest.approx(own[name], rel=1e-5)
    # fcfs: the two after it; sjf: one either side; priority: the two before it.
    near = {"fcfs": order[1:], "sjf": order[::2], "priority": order[:2]}
    for policy, names in near.items():
        factor = np.mean([own[n] for n in names])
        assert table.loc[policy, "neighbour_speed_factor"] == pytest.approx(factor, rel=1e-5)
        sim = runs / "synthetic" / f"{policy}-sim-neighbours" / "metrics.json"
        assert json.loads(sim.read_text())["latency_scale"] == pytest.approx(factor, rel=1e-5)
        # A bound on gross error only: the neighbours are other runs of 12 requests,
        # seconds apart on a shared VM whose speed can move by a third between them;
        # the plumbing is checked exactly above.
        assert abs(table.loc[policy, "nb_err_tpot_s_mean"]) < 0.5
    # Every real run in the order it ran, with its own speed.
    speeds = pd.read_csv(tmp_path / "out" / "run_speeds.csv")
    assert list(speeds["run"]) == order and list(speeds["order"]) == [1, 2, 3]
    assert speeds["own_speed"].to_numpy() == pytest.approx([own[n] for n in order], rel=1e-5)
    assert "## The machine's speed, run by run" in (tmp_path / "out" / "fidelity.md").read_text()


def test_rounds_reverse_every_other_round_so_a_steady_drift_cancels():

    policies = ["fcfs", "sjf", "priority", "vtc"]
    assert rounds(policies, 1) == [policies]
    order = rounds(policies, 4)
    assert order[1] == order[3] == policies[::-1] and order[2] == policies
    # A machine slowing down linearly run by run: in one fixed order the last
    # policy runs slowest in every round; reversed rounds give each the same mean.
    ran = [p for r in order for p in r]
    slowdown = {p: np.mean([i for i, q in enumerate(ran) if q == p]) for p in policies}
    assert len(set(slowdown.values())) == 1
    fixed = [p for _ in range(4) for p in policies]
    assert len({np.mean([i for i, q in enumerate(fixed) if q == p]) for p in policies}) == 4


def test_runs_on_another_machine_than_their_profile_are_named(tmp_path):
    def run(name: str, **metrics) -> Path:
        path = tmp_path / "azure_conv" / name
        path.mkdir(parents=True)
        (path / "metrics.json").write_text(json.dumps(metrics))
        return path

    epyc = SimpleNamespace(header={"machine": "AMD EPYC, AVX2"}, source="p.csv")
    old = SimpleNamespace(header={"cpu": "Intel Xeon, AVX512"}, source="old.csv")
    older = SimpleNamespace(header={}, source="older.csv")  # a table that does not say
    same, other = run("fcfs-real", machine="AMD EPYC, AVX2"), run("sjf-real", machine="NVIDIA H200")
    unsaid = run("vtc-real")  # a run from before metrics.json said
    lines = machine_mismatches(
        [(same, epyc), (other, epyc), (same, old), (unsaid, epyc), (other, older)]
    )
    assert lines == [
        "WARNING: azure_conv/sjf-real ran on NVIDIA H200; its latency model (p.csv) "
        "was profiled on AMD EPYC, AVX2",
        "WARNING: azure_conv/fcfs-real ran on AMD EPYC, AVX2; its latency model (old.csv) "
        "was profiled on Intel Xeon, AVX512",
    ]


def test_window_speeds_divide_each_stretch_by_its_prediction():

    steps = pd.DataFrame(
        dict(
            start_s=[0.0, 30.0, 59.9, 60.0, 130.0, 131.0],
            latency_s=[1.0, 1.0, 2.0, 3.0, 1.0, 1.0],
            pred_s=[1.0, 1.0, 1.0, 2.0, 2.0, 2.0],
        )
    )
    # 0-60 s: 4 over 3; 60-120 s: 3 over 2; 120-180 s: 2 over 4.
    assert window_speeds(steps) == pytest.approx([4 / 3, 1.5, 0.5])
    assert window_speeds(steps, width_s=200) == pytest.approx([9 / 9])


def test_a_runs_speed_trace_fills_windows_without_a_step():

    steps = pd.DataFrame(
        dict(
            start_s=[12.0, 15.0, 31.0, 39.0],
            latency_s=[1.0, 2.0, 1.0, 1.0],
            pred_s=[1.0, 1.0, 2.0, 2.0],
            num_reqs=[1, 1, 1, 1],
            num_prefill_tokens=[0, 0, 0, 0],
        )
    )
    trace = run_speed_trace(steps, width_s=10.0)
    own = own_speed(step_errors(steps))  # 5 s busy over 6 s predicted
    assert own == pytest.approx(5 / 6)
    # 0-10 s had no step (the run's own speed), 20-30 s neither (the one before).
    assert trace.starts == [0.0, 10.0, 20.0, 30.0]
    assert trace.speeds == pytest.approx([own, 1.5, 1.5, 0.5])


def test_speed_summary_per_trace_in_run_order():

    speeds = pd.DataFrame(
        dict(
            order=[1, 2, 3, 4, 5],
            trace=["a", "b", "a", "a", "b"],
            own_speed=[1.0, 2.0, 1.2, 0.8, 2.0],
            window_cv=[0.01, 0.02, 0.03, 0.05, 0.04],
        )
    ).sample(frac=1, random_state=1)  # the rows' order must not matter
    out = speed_summary(speeds).set_index("trace")
    a = out.loc["a"]
    assert a["runs"] == 3 and a["own_min"] == 0.8 and a["own_max"] == 1.2
    assert a["own_cv"] == pytest.approx(np.std([1.0, 1.2, 0.8]) / 1.0)
    assert a["adjacent_change"] == pytest.approx((0.2 + 0.4) / 2)  # 1.0 -> 1.2 -> 0.8
    assert a["within_run_cv"] == pytest.approx(0.03)
    assert out.loc["b", "adjacent_change"] == 0 and out.loc["b", "own_cv"] == 0
    one = speed_summary(speeds[speeds["order"] == 2])
    assert np.isnan(one.loc[0, "adjacent_change"])


@pytest.mark.slow
def test_a_run_in_its_own_process_stopped_by_its_parent_writes_what_it_measured(tmp_path):
    """The experiment runs each real run in a fresh process (run_isolated); stopped
    (Ctrl-C, or SIGTERM from a timeout: a KeyboardInterrupt in the parent), the
    parent stops the child, which writes the run's files marked partial, as a
    run in the parent's own process would."""
    import signal

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    run = tmp_path / "run"
    overrides = ["mode=real", "trace.num_requests=400", "trace.rate=4", "mode.max_wall_s=200"]
    overrides += ["logging=disabled", "progress=false", "plots=false"]
    old = signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(25)  # the child is replaying by then (it starts in a few seconds)
    try:
        run_isolated(overrides, run)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["partial"] is True and metrics["stop_reason"] == "interrupted", metrics
    assert 0 < metrics["num_finished"] < 400
    assert len(pd.read_csv(run / "steps.csv")) > 0
