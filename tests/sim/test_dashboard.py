"""The sweep dashboard: what a person opening ``dashboard.html`` would see."""

from __future__ import annotations

import html
import json
import re
import subprocess
import sys

import pandas as pd
import pytest

from testbed.dashboard import main as dashboard_main
from testbed.report.dashboard import build
from tests.sim.helpers import QUIET, ROOT


def page_data(text: str) -> dict:
    found = re.search(
        r"<script type='application/json' id='dashboard-data'>(.*?)</script>", text, re.S
    )
    assert found, "the page embeds its data"
    return json.loads(found.group(1).replace("<\\/", "</"))


@pytest.mark.integration
def test_a_sweep_writes_a_dashboard_whose_numbers_are_its_runs(tmp_path):
    cmd = [
        sys.executable, str(ROOT / "run.py"), "-m", "mode=sim", "policy=fcfs,sjf",
        "trace.rate=2,8", "seed=0,1", "trace.num_requests=60",
        *[q for q in QUIET if q != "plots=false"], f"hydra.sweep.dir={tmp_path}",
    ]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stderr
    page = tmp_path / "dashboard.html"
    assert "dashboard (opens offline)" in res.stdout and page.exists()
    text = page.read_text()
    # self-contained: plotly's JavaScript inlined, nothing fetched
    assert not re.search(r"<script[^>]+src=", text) and "Plotly.newPlot" in text
    assert text.count('class="plotly-graph-div"') == 4  # latency, CDFs, fairness, timeline
    data = page_data(text)
    assert len(data["runs"]) == 8
    for row in data["runs"]:
        metrics = json.loads((tmp_path / row["run"] / "metrics.json").read_text())
        for key in ("policy", "seed", "ttft_s_p99", "e2e_s_mean", "tenant_service_jain"):
            assert row[key] == metrics[key], (row["run"], key)
        assert row["x"] in (2.0, 8.0)
    # one condition per policy and rate, each over its two seeds: their spread
    conds = {(c["series"], c["x"]): c for c in data["conditions"]}
    assert len(conds) == 4 and all(c["seeds"] == 2 for c in conds.values())
    fcfs8 = conds[("fcfs | synthetic", 8.0)]["e2e_s_mean"]
    runs = [r["e2e_s_mean"] for r in data["runs"] if r["policy"] == "fcfs" and r["x"] == 8.0]
    assert fcfs8["kind"] == "range" and (fcfs8["lo"], fcfs8["hi"]) == (min(runs), max(runs))
    assert fcfs8["mean"] == pytest.approx(sum(runs) / 2)
    table = pd.read_csv(tmp_path / "sweep_conditions.csv")
    row = table[(table["series"] == "fcfs | synthetic") & (table["x"] == 8.0)].iloc[0]
    assert (row["e2e_s_mean_lo"], row["e2e_s_mean_hi"]) == (min(runs), max(runs))
    assert row["interval"] == "range" and row["seeds"] == 2
    # the summary table shows each run's numbers as the run folder has them
    first = data["runs"][0]["run"]
    assert f"<td data-key='{html.escape(json.dumps(first))}'>{html.escape(first)}</td>" in text


def fake_run(folder, name, overrides, **metrics):
    run = folder / name
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    base = {"mode": "sim", "trace": "synthetic", "num_finished": 10, "throughput_req_s": 1.0,
            "ttft_s_p50": 0.1, "tpot_s_mean": 0.01, "e2e_s_mean": 2.0}  # fmt: skip
    (run / "metrics.json").write_text(json.dumps(base | metrics))


def test_policies_apart_beyond_their_intervals_are_named_and_sim_real_pairs_shown(tmp_path):
    for seed in range(5):
        for policy, ttft in (("fcfs", 1.0), ("sjf", 0.5)):
            fake_run(
                tmp_path, f"{policy}-{seed}", [f"policy={policy}", f"seed={seed}"],
                policy=policy, seed=seed, ttft_s_p99=ttft + 0.01 * seed,
            )  # fmt: skip
    fake_run(tmp_path, "real-fcfs", ["mode=real", "policy=fcfs"], mode="real", policy="fcfs")
    fake_run(tmp_path, "sim-fcfs", ["mode=sim", "policy=fcfs"], policy="fcfs", e2e_s_mean=2.2)
    text = build(tmp_path)
    data = page_data(text)
    (apart,) = data["differences"]  # the only metric that differs
    assert (apart["metric"], apart["lower"], apart["higher"]) == ("ttft_s_p99", "sjf", "fcfs")
    assert apart["gap"] == pytest.approx(1.02 / 0.52 - 1)
    assert "sjf 0.52 ± 0.01963 &lt; fcfs 1.02 ± 0.01963 (+96.2%)" in text
    ci = next(c for c in data["conditions"] if c["series"] == "sjf | synthetic | mode=sim")[
        "ttft_s_p99"
    ]
    assert ci["kind"] == "ci95" and ci["n"] == 5
    assert "Runs against their references" in text and "+10.0%" not in text  # errors as numbers
    # per setting (sim, real): latency, CDFs, fairness; then the timeline and sim-vs-real
    assert text.count('class="plotly-graph-div"') == 2 * 3 + 2


def test_the_command_names_a_folder_without_runs(tmp_path, capsys):
    assert dashboard_main([str(tmp_path)]) == 2
    assert "no run folder with a metrics.json" in capsys.readouterr().err
    assert dashboard_main([str(tmp_path / "missing")]) == 2
