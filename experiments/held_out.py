"""How the latency model predicts batch compositions its profile does not hold.

For each profile table given, it fits :class:`~testbed.sim.profile_model.ProfileModel`
twice: to the whole table, and to the table without one group of grid points
(``--leave-out``), then predicts that group's points with both. The whole fit's
error on them is how well one model serves them and every other step; the
held-out fit's error is what a profile without such points predicts for them,
as a simulation of a workload that produces them (and of a profile measured
before the grid had them) would. Groups:

- ``cached_prefix``: prefills after a prefix the engine holds cached, as prefix
  sharing produces (Mooncake's conversations): attention over a long context
  beside few tokens computed;
- ``mixed``: prefills beside decodes;
- ``long_prefill``: prefills of 1,024 tokens or more.

With ``--runs`` (real run directories, e.g. a fidelity experiment's), both
fits also predict every step of those runs: the error of the summed busy time of
the steps with a prefill chunk beside that of plain decode steps (predicted over
measured, less 1; the machine's speed moves both alike, so their difference is
the model's). Prints the tables and writes them as CSV and Markdown with the
summaries in JSON to ``--out``.

    python experiments/held_out.py profiles/cpu1/dummy-llama.csv --out /tmp/held_out
    python experiments/held_out.py outputs/fidelity/<stamp>/profiles/cpu1/dummy-llama.csv \
        --runs outputs/fidelity/<stamp>/mooncake_conv/*-real
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments.fidelity import busy_steps, error_ratio, markdown_table, step_errors  # noqa: E402
from testbed.profile_table import (  # noqa: E402
    read_profile_header,
    write_profile,
)
from testbed.sim.latency import FEATURES  # noqa: E402
from testbed.sim.profile_model import ProfileModel  # noqa: E402

GROUPS: dict[str, Callable[[pd.DataFrame], pd.Series]] = {
    "cached_prefix": lambda t: t.get("prefix_tokens", pd.Series(0, index=t.index)).fillna(0) > 0,
    "mixed": lambda t: (t["decode_batch"] > 0) & (t["prefill_tokens"] > 0),
    "long_prefill": lambda t: t["prefill_tokens"] >= 1024,
}


def fit_without(path: Path, table: pd.DataFrame, drop: pd.Series) -> ProfileModel:
    """The latency model fitted to ``path``'s table less the rows ``drop`` marks."""
    with tempfile.TemporaryDirectory() as tmp:
        kept = Path(tmp) / path.name
        write_profile(kept, read_profile_header(path), table[~drop])
        return ProfileModel(kept)


def fits(path: str | Path, group: str) -> tuple[pd.DataFrame, dict]:
    """``group``'s grid points in ``path``'s table, and the latency model fitted
    to the whole table (``whole``) and to it without them (``held_out``)."""
    path = Path(path)
    table = pd.read_csv(path, comment="#")
    points = (table["kind"] == "step") & (table["grid"] == "point")
    drop = points & GROUPS[group](table)
    if not drop.any():
        raise ValueError(f"{path}: no grid point of group {group!r} (a profile from before it?)")
    return table[drop], dict(whole=ProfileModel(path), held_out=fit_without(path, table, drop))


def run_steps(models: dict, runs: list[Path]) -> pd.DataFrame:
    """Each fit's error on the real runs' steps: steps with a prefill chunk and
    plain decode steps, summed busy time, one row per run and fit."""
    rows = []
    for run in runs:
        for name, model in models.items():
            err = step_errors(busy_steps(run, model))
            rows.append(
                dict(
                    run=run.name,
                    fit=name,
                    prefill=err.get("step_err_prefill_total", np.nan),
                    decode=err.get("step_err_decode_total", np.nan),
                    total=err["step_err_total"],
                )
            )
    out = pd.DataFrame(rows)
    out["prefill_vs_decode"] = error_ratio(out["prefill"], out["decode"])
    return out


def held_out(path: str | Path, group: str) -> tuple[pd.DataFrame, dict]:
    """One row per grid point of ``group`` in the profile at ``path``: measured,
    predicted by the whole fit and by the fit without the group, and their
    relative errors (predicted over measured, less 1); and the two fits."""
    rows, models = fits(path, group)
    point = ["decode_batch", "context", "prefill_tokens", "prefix_tokens"]
    out = rows.reindex(columns=point, fill_value=0)  # (no prefix_tokens before 12-02)
    out["measured_s"] = rows["latency_s"]
    for name, model in models.items():
        pred = model.predict_many(*(rows[c].to_numpy(float) for c in FEATURES))
        out[f"{name}_s"] = pred
        out[f"{name}_err"] = pred / out["measured_s"] - 1
    out.insert(0, "profile", str(path))
    return out.reset_index(drop=True), models


def summary(table: pd.DataFrame) -> dict:
    """Mean and largest absolute error of each fit over the group's points."""
    return {
        f"{name}_{stat}": float(f(table[f"{name}_err"]))
        for name in ("whole", "held_out")
        for stat, f in (("mean_err", np.mean), ("max_abs_err", lambda e: np.abs(e).max()))
    }


def points_markdown(table: pd.DataFrame) -> str:
    """:func:`held_out`'s rows as Markdown (latencies in ms)."""
    columns = ["profile", "decodes", "context", "prefill", "after cached", "measured ms"]
    columns += ["whole fit ms", "error", "held-out fit ms", "error"]
    rows = [
        [r["profile"]]
        + [str(int(r[c])) for c in ("decode_batch", "context", "prefill_tokens", "prefix_tokens")]
        + [f"{r['measured_s'] * 1e3:.2f}", f"{r['whole_s'] * 1e3:.2f}", f"{r['whole_err']:+.1%}"]
        + [f"{r['held_out_s'] * 1e3:.2f}", f"{r['held_out_err']:+.1%}"]
        for _, r in table.iterrows()
    ]
    return markdown_table(columns, rows, left=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profiles", nargs="+", type=Path, help="profile tables (profiles/<hw>/<m>.csv)")
    ap.add_argument("--leave-out", default="cached_prefix", choices=sorted(GROUPS))
    ap.add_argument("--out", type=Path, help="folder for held_out.csv, .md and .json")
    ap.add_argument("--runs", nargs="*", type=Path, default=[], help="real run directories")
    args = ap.parse_args()
    results = [held_out(p, args.leave_out) for p in args.profiles]
    tables = [table for table, _ in results]
    every = pd.concat(tables, ignore_index=True)
    sums = {str(p): summary(t) for p, t in zip(args.profiles, tables, strict=True)}
    steps = pd.concat(
        [run_steps(models, args.runs).assign(profile=str(p))
         for p, (_, models) in zip(args.profiles, results, strict=True) if args.runs]
        or [pd.DataFrame()]
    )  # fmt: skip
    text = (
        f"Grid points of group `{args.leave_out}`: measured against the fit to the whole\n"
        "profile and the fit without them (error: predicted over measured, less 1).\n\n"
        + points_markdown(every)
        + "\n"
        + markdown_table(
            ["profile", *(k.replace("_", " ") for k in summary(tables[0]))],
            [[p, *(f"{v:+.1%}" for v in s.values())] for p, s in sums.items()],
            left=1,
        )
    )
    if len(steps):
        columns = ["profile", "run", "fit", "prefill steps", "decode steps", "prefill vs decode"]
        text += "\nThe real runs' steps, summed busy time (predicted over measured, less 1):\n\n"
        text += markdown_table(
            columns,
            [
                [r["profile"], r["run"], r["fit"]]
                + [f"{r[c]:+.1%}" for c in ("prefill", "decode", "prefill_vs_decode")]
                for _, r in steps.iterrows()
            ],
            left=3,
        )
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        every.to_csv(args.out / "held_out.csv", index=False, float_format="%.6g")
        (args.out / "held_out.md").write_text(text + "\n")
        if len(steps):
            steps.to_csv(args.out / "held_out_steps.csv", index=False, float_format="%.6g")
        meta = dict(leave_out=args.leave_out, profiles=sums)
        (args.out / "held_out.json").write_text(json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
    main()
