"""Does the idle probe follow the machine's speed? A check on fidelity's real runs.

For every real run of a ``fidelity.py --idle-probe`` invocation, compares two
measures of how much slower (>1) or faster the machine ran than when it was
profiled:

- ``own``: the run's busy time over the profile's prediction of the same steps
  (fidelity's own-speed factor: measured on the run itself);
- ``idle``: the run's median idle-probe sample over the profile's
  (``idle_probe_s`` in its header): measured apart from the run's steps.

Per run and per window of ``--window`` seconds within each run (steps and probe
samples in the same window), it prints the two and their difference, and writes
the table and summary to JSON. A probe that follows the drift has ``idle``
within a few percent of ``own`` and a high correlation across runs.

    python experiments/idle_probe_tracking.py outputs/fidelity/<stamp> --out results.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments.fidelity import busy_steps  # noqa: E402
from testbed.sim.profile_model import ProfileModel  # noqa: E402


def run_factors(run: Path, model: ProfileModel, reference: float, window: float):
    """(the run's row, its windows' rows)."""
    steps = busy_steps(run, model)
    probe = pd.read_csv(run / "idle_probe.csv")
    row = dict(
        run=f"{run.parent.name}/{run.name}",
        own=float(steps["latency_s"].sum() / steps["pred_s"].sum()),
        idle=float(probe["probe_s"].median() / reference),
        samples=len(probe),
    )
    windows = []
    for k, part in steps.groupby((steps["start_s"] // window).astype(int)):
        lo, hi = k * window, (k + 1) * window
        inside = probe[(probe["time_s"] >= lo) & (probe["time_s"] < hi)]
        if len(inside) >= 5 and len(part) >= 50:
            windows.append(
                dict(
                    run=row["run"],
                    start_s=lo,
                    own=float(part["latency_s"].sum() / part["pred_s"].sum()),
                    idle=float(inside["probe_s"].median() / reference),
                    samples=len(inside),
                )
            )
    return row, windows


def corr(a: pd.Series, b: pd.Series) -> float | None:
    """Pearson's r, or None where it is undefined (under 3 points, or a constant)."""
    if len(a) < 3 or a.std() == 0 or b.std() == 0:
        return None
    return float(np.corrcoef(a, b)[0, 1])


def summary(table: pd.DataFrame) -> dict:
    diff = table["idle"] / table["own"] - 1
    return dict(
        n=len(table),
        corr=corr(table["own"], table["idle"]),
        mean_abs_diff=float(diff.abs().mean()),
        max_abs_diff=float(diff.abs().max()),
        within_2pct=int((diff.abs() <= 0.02).sum()),
        within_5pct=int((diff.abs() <= 0.05).sum()),
        own_range=[float(table["own"].min()), float(table["own"].max())],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", help="a fidelity.py --idle-probe runs folder")
    ap.add_argument("--window", type=float, default=60.0, help="seconds per window")
    ap.add_argument("--out", help="write the tables and summaries here (JSON)")
    args = ap.parse_args()
    runs = Path(args.runs)
    (profile,) = (runs / "profiles").glob("*/*.csv")
    model = ProfileModel(profile)
    if "idle_probe_s" not in model.header:
        raise SystemExit(f"{profile} records no idle_probe_s: profiled before the idle probe")
    reference = float(model.header["idle_probe_s"].split()[0])
    rows, windows = [], []
    for run in sorted(runs.glob("*/*-real*")):
        if run.name.endswith("-mean") or not (run / "idle_probe.csv").exists():
            continue
        if json.loads((run / "metrics.json").read_text()).get("partial"):
            print(f"{run}: partial run, left out")
            continue
        row, wins = run_factors(run, model, reference, args.window)
        rows.append(row)
        windows += wins
    if not rows:
        raise SystemExit(f"{runs}: no finished real run with idle_probe.csv")
    per_run, per_window = pd.DataFrame(rows), pd.DataFrame(windows)
    per_run["diff"] = per_run["idle"] / per_run["own"] - 1
    print(f"profile {profile}: idle probe {reference * 1e3:.3f} ms")
    print(per_run.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    result = dict(profile=str(profile), reference_s=reference, per_run=summary(per_run))
    print("per run:", result["per_run"])
    if len(per_window):
        result[f"per_window_{args.window:g}s"] = summary(per_window)
        print(f"per {args.window:g}-s window:", result[f"per_window_{args.window:g}s"])
    if args.out:
        result.update(runs=rows, windows=windows)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
