"""experiments/profile_level.py on a runs folder written by hand: a profile pass
whose grid ran 3% faster than its replay, and a real run on a machine 10% slower,
which the reference probe saw."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pytest

from experiments import profile_level

TRUTH = np.array([4e-3, 3e-4, 1e-4, 5e-9, 2e-8])  # constant, requests, tokens, pairs, kv
SHAPES = [(r, n, c) for r in (1, 2, 4, 8) for n in (1, 64) for c in (64, 1024)]
PROFILED = 0.02  # the profile's reference probe, seconds


def step(reqs: int, tokens_per: int, ctx: int, factor: float) -> dict:
    t, p, k = reqs * tokens_per, reqs * tokens_per * (ctx + tokens_per / 2), reqs * ctx
    return dict(
        num_reqs=reqs,
        num_tokens=t,
        attn_pairs=p,
        kv_tokens=k,
        max_kv=ctx + tokens_per,
        latency_s=float(TRUTH @ [1, reqs, t, p, k]) * factor,
    )


def write_runs(runs, phases: str = ""):
    """A runs folder; ``phases``: more header lines (the reference by phase)."""
    rows = [dict(kind="step", grid="point", **step(*s, 0.97)) for s in SHAPES]
    rows += [dict(kind="step", grid="replay", **step(*s, 1.0)) for s in SHAPES * 10]
    header = f"# device: test\n# reference_probe_s: {PROFILED} (median of 10 samples)\n{phases}"
    for path in (runs / "profiles/cpu1/m.csv", runs / "profile-passes/1/cpu1/m.csv"):
        path.parent.mkdir(parents=True)
        path.write_text(header + pd.DataFrame(rows).to_csv(index=False))
    run = runs / "synthetic" / "fcfs-real"
    run.mkdir(parents=True)
    steps = pd.DataFrame([step(*s, 1.1) for s in SHAPES * 3])
    steps["num_prefill_tokens"] = np.where(steps["num_tokens"] > steps["num_reqs"], 64, 0)
    steps["num_decode_tokens"] = steps["num_tokens"] - steps["num_prefill_tokens"]
    steps["start_s"] = np.arange(len(steps), dtype=float)
    steps.drop(columns="num_tokens").to_csv(run / "steps.csv", index=False)
    (run / "metrics.json").write_text(json.dumps({"reference_probe_s": PROFILED * 1.1}))


def test_the_grid_runs_fast_the_replay_and_the_run_match_the_reference(tmp_path):
    runs = tmp_path / "runs"
    write_runs(runs)
    shutil.copytree(runs / "synthetic" / "fcfs-real", runs / "synthetic" / "fcfs-real-2")
    table = profile_level.folder_table(runs).set_index("what")
    assert table.loc["pass 1 replay", "own_per_ref"] == pytest.approx(1.0, rel=1e-9)
    assert table.loc["pass 1 point", "own_per_ref"] == pytest.approx(0.97, rel=1e-6)
    run = table.loc["synthetic fcfs-real"]
    assert run["reference"] == pytest.approx(1.1) and run["own_per_ref"] == pytest.approx(1.0)
    # The fit alone sits between grid and replay (the grid weighs a quarter as much).
    level = table["level"].iloc[0]
    assert 1.0 < level < 1 / 0.97
    assert (table["part"] == "real_runs").sum() == 2  # the repeat counts too
    s = profile_level.summary(table.reset_index())["runs"]
    assert s["own_per_ref_real_runs"] == pytest.approx(1.0)
    assert s["own_per_ref_real_runs_sd"] == pytest.approx(0.0, abs=1e-12)
    assert s["own_per_ref_grid"] == pytest.approx(0.97, rel=1e-6)


def test_a_folder_without_a_reference_is_refused_by_name(tmp_path):
    runs = tmp_path / "runs"
    write_runs(runs)
    for path in runs.glob("profiles/*/*.csv"):
        path.write_text(
            "\n".join(path.read_text().splitlines()[0:1] + path.read_text().splitlines()[2:])
        )
    with pytest.raises(SystemExit, match="no reference_probe_s"):
        profile_level.folder_table(runs)


def test_a_folder_without_profiler_passes_is_refused_by_name(tmp_path):
    runs = tmp_path / "runs"
    write_runs(runs)
    shutil.rmtree(runs / "profile-passes")
    with pytest.raises(SystemExit, match="no profile-passes"):
        profile_level.folder_table(runs)


def test_a_grid_fast_because_the_machine_was_is_told_by_the_phases_reference(tmp_path):
    # The reference ran 3% faster during the grid than during the replay: the
    # grid's 3% is the machine's, and against its own phase it matches.
    runs = tmp_path / "runs"
    phases = f"# reference_probe_grid_s: {PROFILED * 0.97} (median of 4 samples)\n"
    phases += f"# reference_probe_replay_s: {PROFILED} (median of 6 samples)\n"
    write_runs(runs, phases)
    table = profile_level.folder_table(runs).set_index("what")
    assert table.loc["pass 1 point", "reference"] == pytest.approx(0.97)
    assert table.loc["pass 1 point", "own_per_ref"] == pytest.approx(1.0, rel=1e-6)
    assert table.loc["pass 1 replay", "own_per_ref"] == pytest.approx(1.0, rel=1e-9)


def test_runs_are_scaled_against_the_profiles_replay_reference_where_it_has_one():
    from types import SimpleNamespace

    from experiments.fidelity.speeds import profile_reference

    whole = {"reference_probe_s": "0.02 (median of 9 samples beside the busy engine)"}
    assert profile_reference(SimpleNamespace(header=whole)) == 0.02
    split = {**whole, "reference_probe_replay_s": "0.021 (median of 5 samples)"}
    assert profile_reference(SimpleNamespace(header=split)) == 0.021
    with pytest.raises(SystemExit, match="records no reference_probe_s"):
        profile_reference(SimpleNamespace(header={}, source="profile x.csv"))
