"""The fidelity experiment's pair errors, from two written runs, and the sweep's
summary giving the same errors for the same pair."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from experiments.fidelity.compare import LATENCIES, STATS, pair_errors
from testbed.metrics.fidelity import TARGETS
from testbed.report.sweep import fidelity_pairs, sweep_runs


def write_run(folder, mode: str, scale: float, **metrics) -> None:
    """A run whose every latency statistic is ``scale`` seconds times its rank,
    with three requests (the last unfinished in simulation)."""
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "overrides.yaml").write_text(f"- mode={mode}\n- policy=fcfs\n")
    stats = {f"{lat}_{s}": scale * (i + 1) for i, lat in enumerate(LATENCIES) for s in STATS}
    written = {"mode": mode, "policy": "fcfs", "throughput_req_s": 2.0,
               "throughput_output_tok_s": 100.0, **stats, **metrics}  # fmt: skip
    (folder / "metrics.json").write_text(json.dumps(written))
    e2e = [scale, 2 * scale, math.nan if mode == "sim" else 3 * scale]
    pd.DataFrame({"request_id": [0, 1, 2], "arrival_s": [0.0, 0.5, 1.0], "e2e_s": e2e}).to_csv(
        folder / "requests.csv", index=False
    )


def test_a_pair_s_errors_join_and_agree_with_the_sweep_summary(tmp_path):
    write_run(tmp_path / "0_sim", "sim", 1.1, throughput_req_s=1.8, ttft_s_p50=0.0)
    write_run(tmp_path / "1_real", "real", 1.0, ttft_s_p50=0.0)
    row = pair_errors(tmp_path / "0_sim", tmp_path / "1_real")
    assert row["err_throughput_req_s"] == pytest.approx(-0.1)
    assert row["err_throughput_output_tok_s"] == pytest.approx(0.0)
    assert row["sim_tpot_s_mean"] == pytest.approx(2.2) and row["real_tpot_s_mean"] == 2.0
    assert row["err_e2e_s_p99"] == pytest.approx(0.1)
    assert math.isnan(row["err_ttft_s_p50"])  # a real p50 of 0: nothing to be relative to
    assert row["joined_requests"] == 2 and row["e2e_corr"] == pytest.approx(1.0)
    # The sweep pairs the same two runs and says the same, leaving out the unmeasured.
    (pair,) = fidelity_pairs(sweep_runs(tmp_path)[0])
    assert (pair["run"], pair["reference"]) == ("0_sim", "1_real")
    assert "ttft_s_p50" not in pair and pair["meets"] is False
    for metric in set(TARGETS) - {"ttft_s_p50"}:
        assert pair[metric] == pytest.approx(row[f"err_{metric}"])


def test_runs_of_other_arrivals_are_refused_naming_both(tmp_path):
    write_run(tmp_path / "sim", "sim", 1.0)
    write_run(tmp_path / "real", "real", 1.0)
    requests = pd.read_csv(tmp_path / "real" / "requests.csv")
    requests.loc[2, "arrival_s"] = 1.5
    requests.to_csv(tmp_path / "real" / "requests.csv", index=False)
    with pytest.raises(ValueError, match="did not replay the same arrivals") as err:
        pair_errors(tmp_path / "sim", tmp_path / "real")
    assert str(tmp_path / "sim") in str(err.value) and str(tmp_path / "real") in str(err.value)
