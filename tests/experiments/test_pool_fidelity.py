"""Pooling fidelity experiments: the statistics per pair, and refusing unlike workloads."""

from __future__ import annotations

import json
import sys

import numpy as np
import pandas as pd
import pytest

from experiments import pool_fidelity
from experiments.fidelity.report import read_experiment
from experiments.pool_fidelity import check_alike, count_within, pool

META = dict(
    load=0.7, num_requests=200, max_model_len=2048, extra=["hardware=cpu1", "trace.num_tenants=4"]
)


def table(rows: list[tuple]) -> pd.DataFrame:
    """fidelity.csv rows: (trace, policy, err_tpot_s_mean, err_e2e_s_mean[, ref_err_...])."""
    columns = ["trace", "policy", "err_tpot_s_mean", "err_e2e_s_mean", "ref_err_e2e_s_mean"]
    return pd.DataFrame(rows, columns=columns[: len(rows[0])])


def test_pool_gives_mean_spread_and_count_within_target_per_pair():
    tables = {
        "a": table([("az", "fcfs", 0.02, -0.06), ("az", "sjf", 0.01, 0.01)]),
        "b": table([("az", "sjf", 0.03, 0.05, 0.09), ("az", "fcfs", 0.04, 0.02, 0.01)]),
        "c": table([("az", "fcfs", -0.03, 0.07), ("az", "sjf", 0.02, -0.02)]),
    }
    pooled = pool(tables).set_index(["policy", "variant", "metric"])
    e2e = pooled.loc[("fcfs", "err", "e2e_s_mean")]
    values = np.array([-0.06, 0.02, 0.07])
    assert e2e["n"] == 3
    assert e2e["mean"] == pytest.approx(values.mean())
    assert e2e["sd"] == pytest.approx(values.std(ddof=1))
    assert e2e["se"] == pytest.approx(values.std(ddof=1) / np.sqrt(3))
    assert (e2e["lowest"], e2e["highest"]) == (-0.06, 0.07)
    assert e2e["within"] == 1  # only b's +2% is within 5%
    assert [e2e["err_a"], e2e["err_b"], e2e["err_c"]] == list(values)  # in the order given
    # a column only one experiment has: pooled over that one, the others blank
    ref = pooled.loc[("sjf", "ref_err", "e2e_s_mean")]
    assert ref["n"] == 1 and ref["mean"] == pytest.approx(0.09) and np.isnan(ref["sd"])
    assert np.isnan(ref["err_a"]) and ref["within"] == 0
    # the pooled means: fcfs TPOT +1.0%, E2E +1.0%; sjf TPOT +2.0%, E2E +1.3%
    both = pool(tables)
    both = both[(both["variant"] == "err")]
    assert count_within(both) == 2
    assert (
        count_within(both.assign(mean=np.where(both["policy"] == "sjf", 0.051, both["mean"]))) == 1
    )


def test_pool_keeps_the_runs_speed_by_window_as_its_own_variant():
    columns = ["trace", "policy", "err_tpot_s_mean", "win_err_tpot_s_mean"]
    tables = {
        "a": pd.DataFrame([("mc", "fcfs", -0.08, 0.01)], columns=columns),
        "b": pd.DataFrame([("mc", "fcfs", 0.06, -0.03)], columns=columns),
    }
    pooled = pool(tables).set_index(["variant", "metric"])
    assert pooled.loc[("win_err", "tpot_s_mean"), "mean"] == pytest.approx(-0.01)
    assert pooled.loc[("err", "tpot_s_mean"), "mean"] == pytest.approx(-0.01)
    assert pooled.loc[("win_err", "tpot_s_mean"), "within"] == 2
    assert pooled.loc[("err", "tpot_s_mean"), "within"] == 0


def test_check_alike_refuses_other_workloads_naming_file_and_field():
    pinned = dict(META, extra=[*META["extra"], "hardware.cpus=[1]"])
    check_alike({"x": META, "y": pinned}, ("hardware.cpus",))  # pinning may differ
    with pytest.raises(SystemExit, match=r"y/fidelity.json: meta.extra .*hardware.cpus"):
        check_alike({"x": META, "y": pinned}, ())
    with pytest.raises(SystemExit, match=r"y/fidelity.json: meta.num_requests is 300"):
        check_alike({"x": META, "y": dict(META, num_requests=300)}, ("hardware.cpus",))
    other = dict(META, extra=["hardware=cpu1", "trace.num_tenants=2"])
    with pytest.raises(SystemExit, match="not the same workload"):
        check_alike({"x": META, "y": other}, ("hardware.cpus",))


def write_experiment(path, meta, rows):
    path.mkdir(parents=True)
    (path / "fidelity.json").write_text(json.dumps({"meta": meta, "rows": []}))
    table(rows).to_csv(path / "fidelity.csv", index=False)
    return path


def test_read_experiment_names_what_is_missing(tmp_path):
    with pytest.raises(SystemExit, match=r"no fidelity.json"):
        read_experiment(tmp_path)
    (tmp_path / "fidelity.json").write_text("{}")
    pd.DataFrame({"trace": ["az"]}).to_csv(tmp_path / "fidelity.csv", index=False)
    with pytest.raises(SystemExit, match=r"fidelity.json: no 'meta'"):
        read_experiment(tmp_path)
    (tmp_path / "fidelity.json").write_text(json.dumps({"meta": META}))
    with pytest.raises(SystemExit, match=r"fidelity.csv: no 'policy' column"):
        read_experiment(tmp_path)
    table([("az", "fcfs", 0.0, 0.0), ("az", "sjf", 0.0, 0.0), ("az", "fcfs", 0.1, 0.1)]).to_csv(
        tmp_path / "fidelity.csv", index=False
    )
    with pytest.raises(SystemExit, match=r"fidelity.csv: rows \[2, 4\] repeat the pair az / fcfs"):
        read_experiment(tmp_path)


def test_main_writes_pooled_tables_with_the_noise_floor_apart(tmp_path, monkeypatch, capsys):
    a = write_experiment(
        tmp_path / "a",
        META,
        [("az", "fcfs (real vs real)", -0.02, -0.03), ("az", "fcfs", 0.02, 0.06)],
    )
    b = write_experiment(
        tmp_path / "b",
        META,
        [("az", "fcfs (real vs real)", 0.01, 0.00), ("az", "fcfs", 0.00, -0.02)],
    )
    out = tmp_path / "out"
    argv = ["pool_fidelity.py", str(a), str(b), "--out", str(out), "--wandb", "disabled"]
    monkeypatch.setattr(sys, "argv", argv)
    pool_fidelity.main()
    pooled = pd.read_csv(out / "pooled.csv")
    assert len(pooled) == 4  # two rows (pair, noise floor) x two metrics
    e2e = pooled[(pooled["policy"] == "fcfs") & (pooled["metric"] == "e2e_s_mean")].iloc[0]
    assert e2e["mean"] == pytest.approx(0.02) and e2e["within"] == 1
    md = (out / "pooled.md").read_text()
    signal, noise = md.split("## The machine's noise floor")
    assert (
        "| az fcfs | +1.0% ± 1.0% | +2.0% ± 4.0% | +2.0% / +6.0% | +0.0% / -2.0% | 1 of 2 |"
        in signal
    )
    assert "real vs real" not in signal and "az fcfs (real vs real)" in noise
    assert json.loads((out / "pooled.json").read_text())["meta"]["a"] == META
    assert json.loads((out / "manifest.json").read_text())["command"]
    assert "within 5% on 1 of 1 pairs" in capsys.readouterr().out
    # --names must name each experiment once
    monkeypatch.setattr(sys, "argv", [*argv, "--names", "s1", "s1"])
    with pytest.raises(SystemExit, match="2 distinct names"):
        pool_fidelity.main()
