"""End-to-end simulated runs through Hydra's compose API."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from policies.fcfs import FCFS
from testbed.errors import InputError
from testbed.job import run_from_config
from tests.sim.helpers import QUIET, compose_cfg, run, run_and_signal
from traces import traces_dir

ROOT = Path(__file__).resolve().parents[2]


def test_default_run_writes_the_run_directory(tmp_path):
    m = run_from_config(
        compose_cfg("logging=disabled", "progress=false", "trace.num_requests=40"), tmp_path
    )
    for f in (
        "metrics.json",
        "requests.csv",
        "steps.csv",
        "ttft_cdf.png",
        "tpot_cdf.png",
        "timeline.png",
    ):
        assert (tmp_path / f).exists(), f
    saved = json.loads((tmp_path / "metrics.json").read_text())
    required = [
        "mode",
        "policy",
        "trace",
        "model",
        "hardware",
        "num_requests",
        "num_finished",
        "num_rejected",
        "duration_s",
        "throughput_req_s",
        "throughput_output_tok_s",
        "throughput_total_tok_s",
        "num_preemptions",
        "prefix_cache_hit_rate",
        "goodput_req_s",
        "slo_attainment",
        "kv_usage_mean",
        "kv_usage_max",
        "wall_s",
        "latency_model",
    ]
    for base in ("ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s"):
        required += [f"{base}_{s}" for s in ("mean", "p50", "p90", "p99")]
    assert not [k for k in required if k not in saved]
    assert m["num_finished"] == m["num_requests"] == 40
    reqs = pd.read_csv(tmp_path / "requests.csv")
    steps = pd.read_csv(tmp_path / "steps.csv")
    assert len(reqs) == 40 and len(steps) == m["num_steps"]
    assert (reqs["first_token_s"] >= reqs["first_scheduled_s"]).all()
    assert (reqs["first_scheduled_s"] >= reqs["arrival_s"]).all()


def test_same_seed_same_metrics_and_throughput_identity(tmp_path):
    a = run(tmp_path, "trace.num_requests=60", name="a")
    b = run(tmp_path, "trace.num_requests=60", name="b")
    c = run(tmp_path, "trace.num_requests=60", "seed=1", name="c")
    skip = {"wall_s", "sim_wall_s", "sim_requests_per_wall_s"}
    assert {k: v for k, v in a.items() if k not in skip} == {
        k: v for k, v in b.items() if k not in skip
    }
    assert a["e2e_s_mean"] != c["e2e_s_mean"]
    reqs = pd.read_csv(tmp_path / "a" / "requests.csv")
    done = reqs[reqs["status"].str.startswith("finished")]
    duration = done["finish_s"].max() - reqs["arrival_s"].min()
    assert a["throughput_output_tok_s"] == pytest.approx(done["output_tokens"].sum() / duration)
    assert a["duration_s"] == pytest.approx(duration)


def test_policies_change_the_outcome_under_load(tmp_path):
    """Heavy load on a small cache: SJF must beat FCFS on mean E2E (the same trace)."""
    load = ["trace.num_requests=150", "trace.rate=40", "engine.num_kv_blocks=400"]
    fcfs = run(tmp_path, *load, "policy=fcfs", name="fcfs")
    sjf = run(tmp_path, *load, "policy=sjf", name="sjf")
    assert sjf["e2e_s_mean"] < fcfs["e2e_s_mean"]


def test_a_run_that_falls_behind_its_trace_says_so(tmp_path, capsys):
    """The backlog when the last request arrives: as the step log's queue shows it,
    over a quarter of the trace (half, with the committed CPU profile) when it arrives at
    twelve times what the engine serves, none at 2 req/s."""
    over = run(tmp_path, "trace.num_requests=300", "trace.rate=80", name="over")
    steps = pd.read_csv(tmp_path / "over" / "steps.csv")
    reqs = pd.read_csv(tmp_path / "over" / "requests.csv")
    # Those waiting then are still waiting after the next step, or were scheduled in it.
    after = steps[steps["start_s"] >= reqs["arrival_s"].max()].iloc[0]
    waiting = over["waiting_at_last_arrival"]
    assert over["overloaded"] and waiting > 75 and over["finished_per_arrival"] < 0.5
    assert after["num_waiting"] <= waiting <= after["num_waiting"] + after["num_reqs"]
    assert over["offered_req_s"] == pytest.approx(80, rel=0.2)
    assert over["offered_req_s"] > 3 * over["throughput_req_s"]
    assert "OVERLOADED: " in capsys.readouterr().out
    steady = run(tmp_path, "trace.num_requests=100", name="steady")
    assert steady["overloaded"] is False and steady["waiting_at_last_arrival"] <= 2
    assert steady["finished_per_arrival"] > 0.9
    assert "OVERLOADED" not in capsys.readouterr().out


def test_a_short_healthy_run_is_given_no_overload_verdict(tmp_path, capsys):
    """20 requests at 2 req/s (TTFT tens of ms): fewer than 95% finished over the
    window, as the engine fills up, but too few arrivals to call that a backlog."""
    m = run(tmp_path, "trace.num_requests=20")
    assert m["finished_per_arrival"] < 0.95 and m["ttft_s_mean"] < 0.1
    assert m["overloaded"] is None and "OVERLOADED" not in capsys.readouterr().out


def test_partial_run_still_writes_what_it_measured(tmp_path):
    m = run(tmp_path, "mode.max_sim_time_s=20")
    assert m["partial"] is True and "max_sim_time_s" in m["stop_reason"]
    # The requests that had yet to arrive are no backlog, and no verdict is given.
    assert m["overloaded"] is None and m["waiting_at_last_arrival"] <= 2
    assert 0 < m["num_finished"] < m["num_requests"]
    reqs = pd.read_csv(tmp_path / "run" / "requests.csv")
    assert m["num_unfinished"] == reqs["status"].isin(["waiting", "running", "preempted"]).sum() > 0
    # Its rates are over the time it ran, not over the span of what finished.
    steps = pd.read_csv(tmp_path / "run" / "steps.csv")
    # It ran to 20 s, or to the end of the step under way then (none if idle at 20 s).
    ran_to = max((steps["start_s"] + steps["latency_s"]).max(), 20)
    assert m["duration_s"] == pytest.approx(ran_to - reqs["arrival_s"].min())
    assert m["throughput_req_s"] == pytest.approx(m["num_finished"] / m["duration_s"])


def test_a_stopped_run_that_fell_behind_is_not_called_overloaded(tmp_path, capsys):
    m = run(tmp_path, "trace.num_requests=300", "trace.rate=80", "mode.max_sim_time_s=6")
    assert m["partial"] and m["finished_per_arrival"] < 0.5
    assert m["overloaded"] is None and "OVERLOADED" not in capsys.readouterr().out


def test_a_run_with_nothing_finished_says_so_in_words(tmp_path, capsys):
    m = run(tmp_path, "mode.max_sim_time_s=0.02")
    assert m["num_finished"] == 0 and 0.02 <= m["duration_s"] < 0.1
    out = capsys.readouterr().out
    assert f"none: no request finished in the {m['duration_s']:.3g} s it ran" in out
    assert "nan" not in out


@pytest.mark.parametrize(
    ("cluster", "header", "replicas"),
    [
        ("cluster=replicas4", "| 4 replicas, router least_outstanding", 4),
        ("cluster=disagg", "| disaggregated 1 prefill + 1 decode (router least_outstanding", 2),
    ],
)
def test_the_summary_names_the_clusters_shape(tmp_path, capsys, cluster, header, replicas):
    m = run(tmp_path, "trace.num_requests=20", cluster)
    assert header in capsys.readouterr().out
    written = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert written["num_replicas"] == m["num_replicas"] == replicas
    assert written["disaggregated"] == (cluster == "cluster=disagg")


def test_oversized_requests_are_rejected_with_reasons(tmp_path, capsys):
    m = run(tmp_path, "trace.num_requests=50", "engine.max_model_len=300")
    reqs = pd.read_csv(tmp_path / "run" / "requests.csv")
    rejected = reqs[reqs["status"] == "rejected"]
    assert m["num_rejected"] == len(rejected) > 0
    assert rejected["reason"].str.contains("max_model_len").all()
    assert m["num_finished"] + m["num_rejected"] == 50
    # The summary says why, the commonest reasons first: the limit as it is, the
    # lengths that varied as their range.
    top = m["top_reject_reasons"]
    folded = rejected["reason"].str.replace(r"\d+", "N", regex=True).value_counts()
    assert top.startswith(f"{folded.iloc[0]} x ")
    out = capsys.readouterr().out
    assert "max_model_len=300" in top and "rejected because" in out and top in out
    too_long = rejected[rejected["reason"].str.startswith("prompt of")]["prompt_tokens"]
    assert too_long.nunique() > 1
    assert f"prompt of {too_long.min()}-{too_long.max()} tokens" in top


def test_wandb_offline_writes_its_run_folder(tmp_path):
    """The default settings (offline W&B, plots): the run's plots are logged too."""
    wandb_dir = tmp_path / "wb"
    overrides = ["trace.num_requests=20", "progress=false", "logging=offline"]
    overrides += [f"logging.wandb.dir={wandb_dir}", "logging.wandb.group=test-group"]
    run_from_config(compose_cfg(*overrides), tmp_path / "run")
    runs = list((wandb_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))
    logged = {p.name.split("_")[0] for p in runs[0].glob("files/media/images/*.png")}
    assert {"ttft", "tpot", "timeline"} <= logged


@pytest.mark.parametrize("trace", ["azure_conv", "mooncake_conv", "sharegpt"])
def test_real_traces_run(tmp_path, trace):
    if not traces_dir().exists():
        pytest.skip(f"shared traces not found at {traces_dir()} (set TESTBED_TRACES_DIR)")
    m = run(
        tmp_path,
        f"trace={trace}",
        "trace.num_requests=200",
        "model=llama3-8b",
        "hardware=h200",
        "engine.max_num_batched_tokens=8192",
    )
    assert m["num_finished"] + m["num_rejected"] == 200
    if trace == "mooncake_conv":
        assert m["prefix_cache_hit_rate"] > 0.1  # the trace's shared prefixes hit


@pytest.mark.slow
def test_hydra_sweeps_with_the_basic_and_joblib_launchers(tmp_path):
    for launcher in ("basic", "joblib"):
        out = tmp_path / launcher
        cmd = [
            sys.executable,
            str(ROOT / "run.py"),
            "-m",
            f"hydra/launcher={launcher}",
            "policy=fcfs,sjf",
            "trace.num_requests=30",
            *QUIET,
            f"hydra.sweep.dir={out}",
        ]
        res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
        assert res.returncode == 0, res.stderr[-2000:]
        policies = sorted(json.loads(p.read_text())["policy"] for p in out.glob("*/metrics.json"))
        assert policies == ["fcfs", "sjf"]
        # The sweep's summary (testbed/report/sweep.py, a Hydra callback): a row per run.
        summary = pd.read_csv(out / "sweep_summary.csv")
        assert sorted(summary["policy"]) == ["fcfs", "sjf"], launcher
        assert "sweep_summary.csv" in res.stdout


def test_a_profile_for_the_hardware_and_model_replaces_the_roofline(tmp_path):
    from tests.sim.test_latency import write_profile

    rows = [
        (r, r * t, r * t * 300.0, r * 300, 1e-3 + 1e-4 * r + 1e-6 * r * t)
        for r in (1, 2, 4, 8, 16)
        for t in (1, 16, 64)
    ]
    (tmp_path / "profiles" / "cpu").mkdir(parents=True)
    write_profile(tmp_path / "profiles" / "cpu" / "dummy-llama.csv", rows)
    m = run(tmp_path, "trace.num_requests=20", f"profiles_dir={tmp_path / 'profiles'}")
    assert m["latency_model"] == "profile" and "dummy-llama.csv" in m["latency_model_source"]
    empty = tmp_path / "no-profiles"
    m = run(tmp_path, "trace.num_requests=20", f"profiles_dir={empty}", name="r2")
    assert m["latency_model"] == "roofline"
    # One-thread CPU hardware is another hardware: its own profile, not cpu's.
    m = run(
        tmp_path,
        "trace.num_requests=20",
        "hardware=cpu1",
        f"profiles_dir={tmp_path / 'profiles'}",
        name="r3",
    )
    assert m["latency_model"] == "roofline" and m["hardware"] == "cpu1"


class ExplodingPolicy(FCFS):
    """FCFS that fails on its 30th arrival (a bug in a researcher's policy)."""

    def __init__(self, victim=None):
        super().__init__(victim)
        self.arrivals = 0

    def on_arrival(self, request, now):
        self.arrivals += 1
        if self.arrivals == 30:
            raise ValueError("boom")


def test_a_failing_run_still_writes_what_it_measured(tmp_path):
    with pytest.raises(RuntimeError, match="what it measured") as info:
        run(
            tmp_path,
            "trace.num_requests=60",
            "policy=custom",
            "policy._target_=tests.sim.test_runs.ExplodingPolicy",
        )
    assert isinstance(info.value.__cause__, ValueError)
    saved = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert saved["partial"] is True and "boom" in saved["stop_reason"]
    assert 0 < saved["num_finished"] < 60
    assert len(pd.read_csv(tmp_path / "run" / "requests.csv")) == 60


def test_steps_record_each_steps_kv_tokens_and_attention_pairs(tmp_path):
    """One request alone: its prefill chunks, then one decode per output token,
    each reading every cached token plus its own (fast path included)."""
    run(
        tmp_path,
        "trace.num_requests=1",
        "trace.prompt.min=300",
        "trace.prompt.max=300",
        "trace.output.min=20",
        "trace.output.max=20",
        "engine.max_num_batched_tokens=128",
    )
    steps = pd.read_csv(tmp_path / "run" / "steps.csv")
    prefill = steps[steps["num_prefill_tokens"] > 0]
    assert list(prefill["kv_tokens"]) == [128, 256, 300]
    # A chunk of n after c cached tokens computes n * (c + (n + 1) / 2) pairs.
    assert list(prefill["attn_pairs"]) == [128 * 64.5, 128 * (128 + 64.5), 44 * (256 + 22.5)]
    decode = steps[steps["num_prefill_tokens"] == 0]
    assert list(decode["kv_tokens"]) == list(range(301, 301 + 19))
    assert (decode["attn_pairs"] == decode["kv_tokens"]).all()
    assert (steps["max_kv"] == steps["kv_tokens"]).all()  # one request: its own


def test_latency_scale_stretches_every_simulated_step(tmp_path):
    one = ["trace.num_requests=1", "trace.prompt.min=300", "trace.prompt.max=300"]
    base = run(tmp_path, *one, name="base")
    slow = run(tmp_path, *one, "mode.latency_scale=1.5", name="slow")
    assert base["latency_scale"] == 1.0 and slow["latency_scale"] == 1.5
    # The model is the profile's; the scale is the simulated machine's.
    assert slow["latency_model_source"] == base["latency_model_source"]
    a = pd.read_csv(tmp_path / "base" / "steps.csv")
    b = pd.read_csv(tmp_path / "slow" / "steps.csv")
    assert len(a) == len(b) > 2  # one request: the same steps
    # Equal to the CSV's 9 digits.
    assert b["latency_s"].to_numpy() == pytest.approx(1.5 * a["latency_s"].to_numpy(), rel=1e-6)
    assert slow["e2e_s_mean"] == pytest.approx(1.5 * base["e2e_s_mean"])
    with pytest.raises(InputError, match=r"mode\.latency_scale=0\.0: must be > 0"):
        run(tmp_path, "trace.num_requests=3", "mode.latency_scale=0", name="bad")


@pytest.mark.slow
def test_a_simulation_stopped_by_ctrl_c_writes_its_files_and_exits_130(tmp_path):
    args = [
        "trace.num_requests=400000",
        "trace.rate=100",
        "mode.fast_forward=false",  # slow enough to be stopped part-way
        *[q for q in QUIET if not q.startswith("progress")],
    ]
    status, _, err = run_and_signal(args, signal.SIGINT, tmp_path)
    assert status == 130, err[-2000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["partial"] is True and metrics["stop_reason"] == "interrupted"
    assert 0 < metrics["num_finished"] < 400_000


def test_an_empty_workload_is_an_error_not_a_run_of_nothing(tmp_path):
    header_only = tmp_path / "empty.csv"
    header_only.write_text("arrival_s,prompt_tokens,output_tokens\n")
    with pytest.raises(InputError, match="trace=csv: no requests to run"):
        run(tmp_path, "trace=csv", f"trace.path={header_only}")
    assert not (tmp_path / "run" / "metrics.json").exists()


def test_metrics_record_the_cluster(tmp_path):
    m = run(tmp_path, "trace.num_requests=40", "cluster=replicas4")
    assert (m["num_replicas"], m["router"]) == (4, "least_outstanding")
    written = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert (written["num_replicas"], written["router"]) == (4, "least_outstanding")


def test_a_run_folder_holds_one_run(tmp_path):
    run(tmp_path, "trace.num_requests=5")
    with pytest.raises(InputError, match="already holds a run"):
        run(tmp_path, "trace.num_requests=5")


def test_a_run_whose_folder_cannot_be_written_says_so_and_writes_elsewhere(
    tmp_path, monkeypatch, capsys
):
    from testbed import job

    write_tables = job.write_tables
    calls = []

    def failing_once(run_dir, *args):
        calls.append(run_dir)
        if len(calls) == 1:
            raise OSError(28, "No space left on device")
        return write_tables(run_dir, *args)

    monkeypatch.setattr(job, "write_tables", failing_once)
    m = run(tmp_path, "trace.num_requests=5")
    out = capsys.readouterr().out
    assert out.index("TTFT mean") < out.index("cannot write the run directory")  # summary first
    fallback = calls[1]
    assert fallback != tmp_path / "run" and f"run directory: {fallback}" in out
    assert json.loads((fallback / "metrics.json").read_text())["num_finished"] == m["num_finished"]


@pytest.mark.slow
def test_a_sweep_with_a_failing_job_summarises_the_rest_and_names_it(tmp_path):
    """The failing job comes first: the jobs after it still run, and the sweep's
    end (its summary, with a FAILED row naming the reason, and its dashboard) is
    still written, with the bad input named in one line, no traceback."""
    cmd = [
        sys.executable, str(ROOT / "run.py"), "-m", "engine.block_size=0,16",
        "trace.num_requests=20", *QUIET, f"hydra.sweep.dir={tmp_path}",
    ]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert res.returncode != 0  # Hydra reports the failed job
    assert "Traceback" not in res.stderr and "must be an integer >= 1" in res.stderr
    summary = pd.read_csv(tmp_path / "sweep_summary.csv", keep_default_na=False)
    assert list(summary["run"]) == [
        "0_engine.block_size=0,trace.num_requests=20",
        "1_engine.block_size=16,trace.num_requests=20",
    ]
    assert summary["failed"][0].startswith("InputError: engine.block_size=0")
    assert summary["failed"][1] == "" and int(summary["num_finished"][1]) == 20
    assert "FAILED 0_engine.block_size=0,trace.num_requests=20: InputError" in res.stdout
    end = res.stdout.rindex("the sweep stopped early (a failed job")
    assert "1_engine.block_size=16" in res.stdout[end:]
    assert (tmp_path / "dashboard.html").exists()


def test_a_custom_policy_is_labelled_by_its_classs_name(tmp_path):
    m = run(tmp_path, "trace.num_requests=5", "policy=custom", "policy._target_=policies.vtc.VTC")
    assert m["policy"] == "vtc"


def test_the_request_table_goes_to_wandb_whole_as_parquet_and_as_a_table_only_when_short(
    tmp_path,
):
    from testbed.report import wandb_log

    class Run:
        id = "r1"

        def __init__(self):
            self.logged, self.artifacts, self.summary = [], [], {}

        def log(self, data):
            self.logged.append(data)

        def log_artifact(self, artifact):
            self.artifacts.append(artifact)

    frame = pd.DataFrame({"request_id": [f"req-{i}" for i in range(20)], "e2e_s": range(20)})
    run_ = Run()
    how = wandb_log.log_requests(run_, frame, tmp_path, table_rows=10)
    assert how == "file artifact requests.parquet (20 rows)" and not run_.logged
    assert run_.summary["requests_logged_as"] == how
    assert [e.path for e in run_.artifacts[0].manifest.entries.values()] == ["requests.parquet"]
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "requests.parquet"), frame)
    small = Run()
    how = wandb_log.log_requests(small, frame.head(10), tmp_path, table_rows=10)
    assert how.endswith("and table") and len(small.logged) == 1 and small.artifacts


def test_an_output_folder_that_cannot_be_written_is_named_before_hydra_starts(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for args in (["hydra.run.dir=" + str(blocker / "run")], ["-m", f"hydra.sweep.dir={blocker}"]):
        cmd = [sys.executable, str(ROOT / "run.py"), *args, *QUIET]
        res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert res.returncode == 2, res.stderr
        assert "cannot be created or written" in res.stderr and "Traceback" not in res.stderr


def test_a_refused_run_leaves_the_folder_it_was_refused_byte_identical(tmp_path):
    """Hydra writes .hydra/ before the run starts: the claim must come first, or the
    refused run's settings replace the other run's record of its own."""
    run_dir = tmp_path / "run"

    def run_py(*args):
        cmd = [sys.executable, str(ROOT / "run.py"), *QUIET, f"hydra.run.dir={run_dir}", *args]
        env = {**os.environ, "TESTBED_NO_BOOTSTRAP": "1"}
        return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)

    assert run_py("trace.num_requests=5", "policy=fcfs").returncode == 0
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert run_dir / ".hydra" / "config.yaml" in before
    refused = run_py("trace.num_requests=6", "policy=sjf", "seed=3")
    assert refused.returncode == 2 and "already holds a run" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


def test_a_run_refused_for_its_input_leaves_the_folder_free_for_the_corrected_one(tmp_path):
    with pytest.raises(InputError, match="no requests to run"):
        empty = tmp_path / "empty.csv"
        empty.write_text("arrival_s,prompt_tokens,output_tokens\n")
        run(tmp_path, "trace=csv", f"trace.path={empty}")
    assert run(tmp_path, "trace.num_requests=5")["num_finished"] == 5


def test_a_trace_variant_is_labelled_by_its_config_not_its_loader(tmp_path):
    """trace=burst builds on the synthetic loader: the run says burst."""
    cmd = [sys.executable, str(ROOT / "run.py"), *QUIET, f"hydra.run.dir={tmp_path}"]
    cmd += ["trace=burst", "trace.num_requests=5"]
    env = {**os.environ, "TESTBED_NO_BOOTSTRAP": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert json.loads((tmp_path / "metrics.json").read_text())["trace"] == "burst"
    assert "sim | fcfs | burst |" in res.stdout
