"""The sweep summary Hydra prints and writes after ``python run.py -m ...``."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from testbed.report.sweep import fidelity_pairs, summary, sweep_runs, write_summary


def job(sweep, num, mode, policy, speed=None, overrides=(), sweep_id=None, **metrics):
    run_dir = sweep / f"{num}_{mode}_{policy}_synthetic"
    (run_dir / ".hydra").mkdir(parents=True)
    if sweep_id is not None:  # the run folder's claim names its sweep
        (run_dir / ".run").write_text(json.dumps({"sweep": sweep_id}))
    lines = [f"- mode={mode}", f"- policy={policy}", *(f"- {o}" for o in overrides)]
    (run_dir / ".hydra" / "overrides.yaml").write_text("\n".join(lines) + "\n")
    m = {"mode": mode, "policy": policy, "trace": "synthetic", "num_finished": 20,
         "throughput_req_s": 1.0, "ttft_s_p50": 0.1, "tpot_s_mean": 0.01, "e2e_s_mean": 2.0,
         **metrics}  # fmt: skip
    if speed is not None:
        m["speed_vs_profile"] = speed
    (run_dir / "metrics.json").write_text(json.dumps(m))


def test_a_sim_real_sweep_pairs_each_simulation_with_its_real_run(tmp_path):
    job(tmp_path, 0, "sim", "fcfs")
    job(tmp_path, 1, "sim", "sjf", e2e_s_mean=2.2)
    job(tmp_path, 2, "real", "fcfs", speed=1.01, e2e_s_mean=2.04, ttft_s_p50=0.095)
    job(tmp_path, 3, "real", "sjf", speed=1.02)
    job(tmp_path, 10, "sim", "vtc")  # no real run of vtc: unpaired
    runs, unread = sweep_runs(tmp_path)
    assert unread == []
    assert [r["run"] for r in runs] == [
        "0_sim_fcfs_synthetic", "1_sim_sjf_synthetic", "2_real_fcfs_synthetic",
        "3_real_sjf_synthetic", "10_sim_vtc_synthetic",
    ]  # fmt: skip
    pairs = {p["run"]: p for p in fidelity_pairs(runs)}
    assert set(pairs) == {"0_sim_fcfs_synthetic", "1_sim_sjf_synthetic"}
    fcfs, sjf = pairs["0_sim_fcfs_synthetic"], pairs["1_sim_sjf_synthetic"]
    assert fcfs["reference"] == "2_real_fcfs_synthetic"
    assert fcfs["e2e_s_mean"] == pytest.approx(2.0 / 2.04 - 1)
    assert fcfs["ttft_s_p50"] == pytest.approx(0.1 / 0.095 - 1)
    assert fcfs["meets"] and not sjf["meets"]  # sjf's E2E is 10% off
    text = write_summary(tmp_path)
    assert "missed" in text and "WARNING" not in text  # speeds within 1%
    table = pd.read_csv(tmp_path / "sweep_summary.csv")
    assert len(table) == 5 and table["speed_vs_profile"].notna().sum() == 2


def test_a_sweep_over_three_modes_compares_each_with_its_references(tmp_path):
    """-m mode=sim,real,vllm: the simulation against both engines, and this
    project's engine against vLLM."""
    job(tmp_path, 0, "sim", "fcfs", e2e_s_mean=2.0)
    job(tmp_path, 1, "real", "fcfs", speed=1.1, e2e_s_mean=2.2)
    job(tmp_path, 2, "vllm", "fcfs", e2e_s_mean=1.6)
    pairs = fidelity_pairs(sweep_runs(tmp_path)[0])
    got = [(p["modes"], p["run"][0], p["reference"][0]) for p in pairs]
    assert got == [("sim vs real", "0", "1"), ("sim vs vllm", "0", "2"), ("real vs vllm", "1", "2")]
    errors = [p["e2e_s_mean"] for p in pairs]
    assert errors == pytest.approx([2.0 / 2.2 - 1, 2.0 / 1.6 - 1, 2.2 / 1.6 - 1])
    assert [p["speed_vs_profile"] for p in pairs] == [1.1, None, None]
    text = summary(sweep_runs(tmp_path)[0])
    assert text.count("2_vllm_fcfs_synthetic") == 3  # its row, and as the reference twice


def test_runs_that_differ_in_more_than_mode_are_not_paired(tmp_path):
    job(tmp_path, 0, "sim", "fcfs", overrides=["load=0.5"])
    job(tmp_path, 1, "real", "fcfs", overrides=["load=0.9"])
    assert fidelity_pairs(sweep_runs(tmp_path)[0]) == []


def test_simulations_at_other_speeds_pair_with_the_one_real_run(tmp_path):
    """mode's fields set how a simulation runs, not what it simulates: sims at
    the profile's speed and at the real run's both pair with it."""
    job(tmp_path, 0, "real", "fcfs", speed=1.2, overrides=["load=0.7"], e2e_s_mean=2.4)
    job(tmp_path, 1, "sim", "fcfs", overrides=["load=0.7"])
    job(tmp_path, 2, "sim", "fcfs", overrides=["load=0.7", "++mode.latency_scale=1.2"],
        e2e_s_mean=2.4)  # fmt: skip
    pairs = fidelity_pairs(sweep_runs(tmp_path)[0])
    assert [p["run"][0] for p in pairs] == ["1", "2"]
    assert all(p["reference"] == "0_real_fcfs_synthetic" for p in pairs)
    assert pairs[0]["e2e_s_mean"] == pytest.approx(2.0 / 2.4 - 1)
    assert pairs[1]["e2e_s_mean"] == pytest.approx(0.0)
    assert pairs[0]["speed_vs_profile"] == 1.2


def test_a_partial_run_is_paired_but_not_judged(tmp_path):
    job(tmp_path, 0, "sim", "fcfs")
    job(tmp_path, 1, "real", "fcfs", partial=True, num_finished=3)
    (pair,) = fidelity_pairs(sweep_runs(tmp_path)[0])
    assert pair["meets"] is None
    assert "partial run" in summary(sweep_runs(tmp_path)[0])


def test_without_kept_overrides_runs_pair_by_what_they_ran(tmp_path):
    """hydra.output_subdir=null keeps no overrides.yaml: the runs' metrics say
    what they ran."""
    job(tmp_path, 0, "sim", "fcfs")
    job(tmp_path, 1, "real", "fcfs")
    job(tmp_path, 2, "real", "sjf")
    for run in tmp_path.iterdir():
        (run / ".hydra" / "overrides.yaml").unlink()
    (pair,) = fidelity_pairs(sweep_runs(tmp_path)[0])
    assert pair["reference"] == "1_real_fcfs_synthetic"


def test_real_runs_on_a_machine_whose_speed_moved_are_flagged(tmp_path):
    job(tmp_path, 0, "real", "fcfs", speed=0.98)
    job(tmp_path, 1, "real", "sjf", speed=1.22)
    text = summary(*sweep_runs(tmp_path))
    assert "WARNING" in text and "24.5% apart" in text


def test_a_broken_metrics_file_is_named_and_the_rest_summarised(tmp_path):
    job(tmp_path, 0, "sim", "fcfs")
    job(tmp_path, 1, "sim", "sjf")
    (tmp_path / "0_sim_fcfs_synthetic" / "metrics.json").write_text("{")  # killed mid-write
    runs, unread = sweep_runs(tmp_path)
    assert [r["run"] for r in runs] == ["1_sim_sjf_synthetic"]
    assert len(unread) == 1 and "0_sim_fcfs_synthetic/metrics.json" in unread[0]
    assert "not read: " in write_summary(tmp_path)
    assert len(pd.read_csv(tmp_path / "sweep_summary.csv")) == 1


def test_a_sweep_without_run_directories_has_no_summary(tmp_path):
    assert write_summary(tmp_path) is None
    assert not (tmp_path / "sweep_summary.csv").exists()


def test_the_summary_holds_its_own_sweeps_jobs_and_pairs_with_earlier_real_runs(tmp_path):
    # Another sweep writing into the same folder (at the same time, or earlier)
    # adds no row; its real run may still pair with this sweep's simulation.
    job(tmp_path, 0, "real", "fcfs", speed=1.0, sweep_id="earlier")
    job(tmp_path, 1, "sim", "sjf", sweep_id="other", e2e_s_mean=9.0)
    job(tmp_path, 2, "sim", "fcfs", sweep_id="mine")
    runs, _ = sweep_runs(tmp_path, "mine")
    assert [r["run"] for r in runs if r["own"]] == ["2_sim_fcfs_synthetic"]
    text = write_summary(tmp_path, "mine")
    table = pd.read_csv(tmp_path / "sweep_summary.csv")
    assert list(table["run"]) == ["2_sim_fcfs_synthetic"]
    assert "0_real_fcfs_synthetic (earlier sweep)" in text and "9" not in table.to_string()


def test_a_failed_job_of_the_sweep_is_named_with_its_error(tmp_path):
    job(tmp_path, 0, "sim", "fcfs", sweep_id="mine")
    failed = tmp_path / "1_sim_sjf_synthetic"
    failed.mkdir()
    record = {"sweep": "mine", "error": "InputError: engine.block_size=0: must be >= 1"}
    (failed / "failed.json").write_text(json.dumps(record))
    text = write_summary(tmp_path, "mine")
    assert "FAILED 1_sim_sjf_synthetic: InputError: engine.block_size=0" in text


def test_the_summary_shows_every_swept_key(tmp_path):
    job(tmp_path, 0, "sim", "fcfs", overrides=["load=0.5", "engine.max_num_seqs=8"])
    job(tmp_path, 1, "sim", "fcfs", overrides=["load=0.9", "engine.max_num_seqs=8"])
    text = write_summary(tmp_path)
    head = text.splitlines()[0].split()
    assert "load" in head and "engine.max_num_seqs" not in head  # the same in both
    table = pd.read_csv(tmp_path / "sweep_summary.csv")
    assert list(table["load"]) == [0.5, 0.9]


def test_a_job_is_read_once_until_its_metrics_change(tmp_path, monkeypatch):
    from testbed.report import sweep as sweep_module

    job(tmp_path, 0, "sim", "fcfs")
    reads = []
    real = sweep_module.job_overrides
    monkeypatch.setattr(sweep_module, "job_overrides", lambda d: reads.append(d) or real(d))
    first, _ = sweep_runs(tmp_path)
    again, _ = sweep_runs(tmp_path)
    assert len(reads) == 1 and again == first  # the second summary reused the row
    path = tmp_path / "0_sim_fcfs_synthetic" / "metrics.json"
    metrics = json.loads(path.read_text()) | {"e2e_s_mean": 2.75}
    path.write_text(json.dumps(metrics))  # rewritten (a longer file): read anew
    (row,), _ = sweep_runs(tmp_path)
    assert row["e2e_s_mean"] == 2.75 and len(reads) == 2


def test_the_summary_counts_each_runs_rejected_requests(tmp_path):
    """A trace that rejects requests for length would otherwise hide it."""
    job(tmp_path, 0, "sim", "fcfs", num_rejected=0)
    job(tmp_path, 1, "sim", "sjf", num_rejected=45)
    text = write_summary(tmp_path)
    assert "rejected" in text.splitlines()[0].split()
    assert list(pd.read_csv(tmp_path / "sweep_summary.csv")["num_rejected"]) == [0, 45]
