"""The deployment search through Hydra (``run.py -m +experiment=deployment_search``,
the basic launcher): its files, its page, and bad settings named."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "model=llama3-8b", "trace=synthetic", "hydra.sweeper.requests_per_instance=20",
    "hydra.sweeper.budget=2", "hydra.sweeper.space.replicas=[1,2]",
    "hydra.sweeper.space.tensor_parallel=[1]", "hydra.sweeper.space.pipeline_parallel=[1]",
    "hydra.sweeper.space.split=[colocated]", "hydra.sweeper.space.max_num_seqs=[4,32]",
    "hydra.sweeper.space.max_num_batched_tokens=[2048]",
    "hydra.sweeper.space.chunked_prefill=[true]", "hydra.sweeper.space.policy=[fcfs]",
    "hydra.sweeper.slos=[tight:0.15:0.012,prefill:0.1:0.02@p90]", "hydra.sweeper.rel_tol=0.2",
]  # fmt: skip


def search(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "run.py"), "-m", "+experiment=deployment_search",
           *TINY, *extra, f"hydra.sweep.dir={tmp_path}"]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)


@pytest.mark.slow
def test_the_search_runs_through_hydra_and_writes_the_front_and_the_best(tmp_path):
    res = search(tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "best configuration per SLO" in res.stdout
    result = json.loads((tmp_path / "search.json").read_text())
    runs = pd.read_csv(tmp_path / "search_runs.csv")
    configs = pd.read_csv(tmp_path / "search_configs.csv")
    assert result["counts"]["space"] == 4 and len(configs) == 4 * 2
    assert result["counts"]["simulations"] == len(runs) > 0
    # every simulation is a run folder of the sweep, whose metrics the verdicts read
    for _, run in runs.iterrows():
        assert not Path(run["run_dir"]).is_absolute()  # the results move with the folder
        metrics = json.loads((tmp_path / run["run_dir"] / "metrics.json").read_text())
        assert metrics["trace"] == "synthetic" and metrics["num_gpus"] == run["gpus"]
        assert metrics["ttft_s_p99"] == pytest.approx(run["ttft_s_p99"], rel=1e-6)
        assert metrics["num_requests"] == 20 * metrics["num_replicas"]
        assert run["met_tight"] == (
            metrics["num_finished"] == metrics["num_requests"] and metrics["ttft_s_p99"] <= 0.15
            and metrics["tpot_s_p99"] <= 0.012
        )  # fmt: skip
    # the best per SLO is the highest rate per GPU any run met it at
    for best in result["best"]:
        met = runs[runs[f"met_{best['slo']}"] == True]  # noqa: E712
        assert best["rate_req_s_per_gpu"] == pytest.approx(met["rate_req_s_per_gpu"].max())
    front = pd.read_csv(tmp_path / "search_front.csv")
    assert set(front["slo"]) == {"tight", "prefill"}
    assert set(front["latency"]) == {"ttft_s", "tpot_s"}
    assert (tmp_path / "search_best.csv").exists()
    page = (tmp_path / "search.html").read_text()
    assert "Plotly.newPlot" in page and not re.search(r"<script[^>]+src=", page)
    assert page.count('class="plotly-graph-div"') == 2  # a front figure per SLO
    assert (tmp_path / "dashboard.html").exists()  # the sweep's own, beside it


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("hydra.sweeper.slos=[tight:0.5]", r"hydra.sweeper.slos\[0\]='tight:0.5': not an SLO"),
        ("hydra.sweeper.space.gpus=[1]", r"hydra.sweeper.space.gpus"),
        ("hydra.sweeper.space.split=[2-1]", r"hydra.sweeper.space.split: '2-1'"),
        ("engine.max_num_seqs=8", r"the search sets engine.max_num_seqs"),
        ("seed=0,1", r"seed=0,1: a sweep has no place"),
        ("trace.num_requests=50", r"sets each run's trace.num_requests"),
    ],
)
def test_a_bad_setting_stops_the_search_before_any_run_naming_the_field(
    tmp_path, override, message
):
    res = search(tmp_path, override)
    assert res.returncode != 0
    assert re.search(message, res.stdout + res.stderr), res.stderr[-2000:]
    assert not list(tmp_path.glob("*/metrics.json"))


@pytest.mark.slow
def test_a_search_stopped_by_sigterm_writes_what_it_found_and_exits_143(tmp_path):
    cmd = [sys.executable, str(ROOT / "run.py"), "-m", "+experiment=deployment_search",
           *TINY, "hydra.sweeper.rel_tol=0.01", f"hydra.sweep.dir={tmp_path}"]  # fmt: skip
    env = {**os.environ, "TESTBED_NO_BOOTSTRAP": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    deadline = time.monotonic() + 300
    while len(list(tmp_path.glob("*/metrics.json"))) < 6 and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, out[-3000:]
    result = json.loads((tmp_path / "search.json").read_text())
    assert result["counts"]["interrupted"] is True
    assert result["counts"]["simulations"] >= 5
    assert "INTERRUPTED" in out and (tmp_path / "search_runs.csv").exists()
