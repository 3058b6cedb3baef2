"""Where a profile's level comes from: its grid, its replay and the real runs, by reference.

For each runs folder of ``experiments.fidelity`` that measured profiler passes
beside a reference probe (``--profile-passes K`` with ``hardware.reference_cpus``),
it sets side by side, each as busy time over the merged profile's prediction of
the same steps (fidelity's own speed) and over the reference probe's factor
(the probe's median beside the busy engine, during the grid or the replay where
the profile's header splits it, over the merged profile's during its replays):

- each pass's grid points (every batch repeated back to back) and its replay
  (the steps of a short trace, in flow);
- every real run.

Where ``own_per_ref`` is the same for a pass's replay and for the real runs, the
reference carries the profile's speed over to the runs; a grid that runs faster
than its replay pulls a fit of both below the replay's level. The latency model
takes its level from the replay (``ProfileModel.level``); ``unscaled_own_per_ref``
is what the fit alone would give. Prints the table, writes it as CSV and
Markdown to ``--out`` (``outputs/profile_level``), with each folder's means in
the JSON and a ``manifest.json``.

    python -m experiments.profile_level outputs/fidelity/<stamp>
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd

from experiments.fidelity.compare import step_errors
from experiments.fidelity.execute import read_metrics
from experiments.fidelity.report import markdown_table
from experiments.fidelity.speeds import busy_steps, own_speed
from experiments.manifest import ROOT, write_manifest
from testbed.profile_table import read_profile_header
from testbed.profiling.reference_probe import reference_key
from testbed.sim.latency import FEATURES
from testbed.sim.profile_model import ProfileModel

PARTS = ("grid", "replay", "real_runs")


def merged_profile(runs: Path) -> Path:
    found = sorted(runs.glob("profiles/*/*.csv"))
    if len(found) != 1:
        raise SystemExit(
            f"{runs}: expected one merged profile under profiles/<hardware>/, found {len(found)} "
            "(a folder of experiments.fidelity run with --profile-passes)"
        )
    return found[0]


def reference_of(path: Path, phase: str = "replay") -> float:
    """A profile's reference probe (seconds) during ``phase`` ("grid" or
    "replay": ``reference_probe_<phase>_s``), or over the whole profile where the
    header does not split it (``reference_probe_s``); a clear error naming the
    file where it has none."""
    header = read_profile_header(path)
    value = header.get(reference_key(header, phase))
    if value is None:
        raise SystemExit(
            f"{path}: no reference_probe_s in its header (the experiment measured it without "
            "hardware.reference_cpus)"
        )
    return float(value.split()[0])


def pass_rows(runs: Path, model: ProfileModel, profiled: float) -> list[dict]:
    """Each profiler pass's grid and replay against the merged model."""
    paths = sorted(
        runs.glob("profile-passes/*/*/*.csv"), key=lambda p: (len(p.parts[-3]), p.parts[-3])
    )
    if not paths:
        raise SystemExit(
            f"{runs}: no profile-passes/<k>/<hardware>/<model>.csv (a folder of the experiment "
            "run with --profile-passes, not one that reused another's runs)"
        )
    rows = []
    for path in paths:
        table = pd.read_csv(path, comment="#")
        missing = {"kind", "grid", *FEATURES, "latency_s"} - set(table.columns)
        if missing:
            raise SystemExit(f"{path}: no column {sorted(missing)} (a profile with a replay)")
        table = table[table["kind"] == "step"]
        for group, part in table.groupby("grid"):
            ref = reference_of(path, "grid" if group == "point" else "replay") / profiled
            pred = model.predict_many(*(part[c].to_numpy(float) for c in FEATURES))
            rows.append(
                dict(
                    what=f"pass {path.parts[-3]} {group}",
                    part="grid" if group == "point" else str(group),
                    steps=len(part),
                    busy_s=part["latency_s"].sum(),
                    own=part["latency_s"].sum() / pred.sum(),
                    reference=ref,
                )
            )
    return rows


def run_rows(runs: Path, model: ProfileModel, profiled: float) -> list[dict]:
    """Each real run (repeats too) against the merged model; a run without a
    reference probe is an error, naming it."""
    rows = []
    for run in sorted(p for p in runs.glob("*/*-real*") if p.is_dir()):
        metrics = read_metrics(run)
        if "reference_probe_s" not in metrics:
            raise SystemExit(f"{run / 'metrics.json'}: no reference_probe_s (run without one)")
        steps = busy_steps(run, model)
        rows.append(
            dict(
                what=f"{run.parent.name} {run.name}",
                part="real_runs",
                steps=len(steps),
                busy_s=steps["latency_s"].sum(),
                own=own_speed(step_errors(steps)),
                reference=metrics["reference_probe_s"] / profiled,
            )
        )
    return rows


def folder_table(runs: Path) -> pd.DataFrame:
    path = merged_profile(runs)
    model = ProfileModel(path)
    profiled = reference_of(path)
    rows = pass_rows(runs, model, profiled) + run_rows(runs, model, profiled)
    if not any(r["part"] == "replay" for r in rows):
        raise SystemExit(f"{runs}: its profiler passes have no replay rows (grid 'replay')")
    table = pd.DataFrame(rows)
    table.insert(0, "runs", runs.name)
    table["own_per_ref"] = table["own"] / table["reference"]
    table["unscaled_own_per_ref"] = table["own_per_ref"] * model.level
    table["level"] = model.level
    return table


def summary(table: pd.DataFrame) -> dict:
    """Per runs folder: the level, and the mean ``own_per_ref`` of the grids, the
    replays and the real runs (with the runs' standard deviation; None where
    there is no such row, or one run)."""

    def number(value: float) -> float | None:
        return None if np.isnan(value) else float(value)

    out = {}
    for runs, t in table.groupby("runs"):
        by_part = t.groupby("part")["own_per_ref"]
        means, sds = by_part.mean(), by_part.std()
        out[runs] = {
            "level": float(t["level"].iloc[0]),
            **{f"own_per_ref_{part}": number(means.get(part, np.nan)) for part in PARTS},
            "own_per_ref_real_runs_sd": number(sds.get("real_runs", np.nan)),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="experiments.fidelity runs folders")
    ap.add_argument("--out", type=Path, default=ROOT / "outputs/profile_level")
    args = ap.parse_args()
    table = pd.concat([folder_table(r) for r in args.runs], ignore_index=True)
    args.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out / "profile_level.csv", index=False)
    shown = table.round(4)
    cells = [[str(v) for v in row] for row in shown.itertuples(index=False)]
    (args.out / "profile_level.md").write_text(markdown_table(list(shown.columns), cells, left=3))
    (args.out / "profile_level.json").write_text(json.dumps(summary(table), indent=2) + "\n")
    write_manifest(args.out, profiles=[merged_profile(r) for r in args.runs])
    print(shown.to_string(index=False))
    print(json.dumps(summary(table), indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
