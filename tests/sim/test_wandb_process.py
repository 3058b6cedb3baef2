"""W&B in a child process: it logs a written run directory when asked, and
finishes its run unlogged when the run fails or its process goes away."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from testbed.report.wandb_process import WandbProcess

pytestmark = pytest.mark.slow  # each starts W&B in a child process (a second or more)


def written_run(folder):
    folder.mkdir(parents=True)
    pd.DataFrame({"time_s": [0.5, 1.5], "num_waiting": [1, 0]}).to_csv(
        folder / "timeline.csv", index=False
    )
    pd.DataFrame({"request_id": ["a", "b"], "e2e_s": [1.0, 2.0]}).to_csv(
        folder / "requests.csv", index=False
    )
    (folder / "metrics.json").write_text(json.dumps({"e2e_s_mean": 1.5, "partial": False}))
    return folder


def offline(tmp_path):
    return {"mode": "offline", "dir": str(tmp_path / "wb"), "project": "t", "tags": ["x"]}


def test_the_child_logs_the_run_directory_it_is_handed(tmp_path):
    run_dir = written_run(tmp_path / "run")
    proc = WandbProcess(offline(tmp_path), run_dir, "sim-fcfs-synthetic", {"seed": 0})
    folder = proc.log(run_dir, [])
    assert proc.proc.returncode == 0 and folder is not None
    files = next((tmp_path / "wb" / "wandb").glob("offline-run-*")) / "files"
    back = pd.read_parquet(files / "requests.parquet")
    assert back["request_id"].tolist() == ["a", "b"]


def test_an_abandoned_or_orphaned_child_finishes_its_run_and_exits(tmp_path):
    run_dir = written_run(tmp_path / "run")
    abandoned = WandbProcess(offline(tmp_path), run_dir, "a", {})
    abandoned.abandon("RuntimeError: boom")
    assert abandoned.proc.returncode == 0
    orphan = WandbProcess(offline(tmp_path), run_dir, "b", {})
    orphan.proc.stdin.close()  # as when the run's process is killed
    assert orphan.proc.wait(timeout=120) == 0
    assert len(list((tmp_path / "wb" / "wandb").glob("offline-run-*"))) == 2


def test_a_failure_in_the_child_is_reported_not_raised(tmp_path, capsys):
    run_dir = tmp_path / "empty"  # nothing written: the child cannot read it
    run_dir.mkdir()
    proc = WandbProcess(offline(tmp_path), run_dir, "c", {})
    assert proc.log(run_dir, []) is None and proc.proc.returncode == 1
    assert "W&B logging failed: FileNotFoundError" in capsys.readouterr().out


def test_disabled_starts_nothing(tmp_path):
    proc = WandbProcess({"mode": "disabled"}, tmp_path, "d", {})
    assert proc.proc is None and proc.log(tmp_path, []) is None
