"""Where a profile misses a real run's steps: by the idle gap before each step,
by step kind, and as a scale against a fixed per-step cost.

For each real run directory given (a fidelity experiment's ``*-real*``), every
busy step of ``steps.csv`` is predicted by the latency model fitted to
``--profile``, and two questions are answered:

- **kinds**: each kind of step (plain decodes; one prompt's chunk; several
  prompts' chunks packed into one step, as a burst gives; prefills beside
  decodes) in total, at the model's level and at the run's own speed: whether
  the model prices the kinds right against each other.
- **gap**: does a step that follows an idle gap (the engine waited for an
  arrival: caches cold, the vCPU perhaps descheduled) run slower or faster
  than one that follows another step? Summed predicted over summed measured
  time, less 1, for steps with a prefill chunk and plain decode steps, by the
  gap before them (< 0.5 ms is back to back).
- **decodes**: plain decode steps by batch size (1, 2, 3, 4 or more) and
  longest context: where in the composition space the profile's fit sits
  above or below what the runs measured (a fit of batch-8 replay steps can
  miss small batches at long contexts, which only grid points show it).
- **affine**: is the run's departure from the profile a change of speed (every
  step scaled alike) or a fixed cost per step that the profile's points do not
  carry? ``measured = a * predicted + b``, fitted by least squares in relative
  terms (each step weighed by 1 / predicted, as the profile is fitted).

    R=outputs/fidelity/<stamp>
    python -m experiments.step_residuals --profile $R/profiles/cpu1/dummy-llama.csv \\
        $R/azure_conv/*-real $R/azure_conv/*-real-2

With ``--compare`` and more profile tables (another pass, a profile measured
later), each one's total error on the same steps, its prefill/decode split and
its small/large decode batch ratio: how much of a shape error is the profile
pass's. Prints the tables and writes ``gaps.csv``, ``decodes.csv``,
``affine.csv``, ``compare.csv``, ``step_residuals.md`` and ``manifest.json`` to
``--out`` (``outputs/step_residuals``), and ``kinds.csv``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd

from experiments.fidelity.compare import error_ratio, step_errors
from experiments.fidelity.report import markdown_table
from experiments.fidelity.speeds import busy_steps
from experiments.manifest import ROOT, write_manifest
from testbed.sim.profile_model import ProfileModel

# upper edges (s) of the idle-gap buckets and their labels
GAP_EDGES = (0.0005, 0.005, 0.05, 0.5, 5.0, np.inf)
GAP_LABELS = ("<0.5 ms", "0.5-5 ms", "5-50 ms", "50-500 ms", "0.5-5 s", ">5 s")


def run_steps(run: Path, model) -> pd.DataFrame:
    """A run's :func:`~experiments.fidelity.speeds.busy_steps` (with the idle gap before
    each, ``gap_s``, and the model's prediction, ``pred_s``), marked by whether
    it carries a prefill chunk, its run and its trace."""
    steps = busy_steps(run, model)
    return steps.assign(
        prefill=steps["num_prefill_tokens"] > 0, run=run.name, trace=run.parent.name
    )


def gap_table(steps: pd.DataFrame) -> pd.DataFrame:
    """Error of summed predicted over summed measured time by kind and idle gap."""
    bucket = np.searchsorted(np.asarray(GAP_EDGES), steps["gap_s"].to_numpy(float), side="right")
    steps = steps.assign(gap=[GAP_LABELS[min(b, len(GAP_LABELS) - 1)] for b in bucket])
    steps = steps.assign(kind=np.where(steps["prefill"], "prefill", "decode"))
    table = steps.groupby(["trace", "kind", "gap"], sort=False).agg(
        steps=("pred_s", "size"), pred_s=("pred_s", "sum"), real_s=("latency_s", "sum")
    )
    table["err"] = table["pred_s"] / table["real_s"] - 1
    order = {label: i for i, label in enumerate(GAP_LABELS)}
    table = table.reset_index()
    table["order"] = table["gap"].map(order)
    return table.sort_values(["trace", "kind", "order"]).drop(columns="order")


STEP_KINDS = ("decode only", "one prefill", "many prefills", "mixed")


def step_kind(steps: pd.DataFrame) -> np.ndarray:
    """Each step's kind: plain decodes; one prompt's chunk alone; several prompts'
    chunks alone (a burst packed into one step); prefill chunks beside decodes.
    A step's prefilling requests are those not decoding (``num_reqs`` less
    ``num_decode_tokens``: one token each, without speculation)."""
    prefills = steps["num_reqs"].to_numpy(int) - steps["num_decode_tokens"].to_numpy(int)
    decodes = steps["num_decode_tokens"].to_numpy(int)
    kinds = np.where(prefills <= 1, "one prefill", "many prefills")
    kinds = np.where(decodes > 0, "mixed", kinds)
    return np.where(steps["num_prefill_tokens"].to_numpy(int) == 0, "decode only", kinds)


def kind_table(steps: pd.DataFrame) -> pd.DataFrame:
    """Each run's summed predicted over summed measured time, less 1, by
    :func:`step_kind`, with the prediction at the run's own speed (scaled so that
    the run's steps in total are predicted exactly): how the model prices each
    kind against the others, whatever the machine's speed during the run."""
    steps = steps.assign(kind=step_kind(steps))
    rows = []
    for (trace, run), part in steps.groupby(["trace", "run"], sort=False):
        speed = part["latency_s"].sum() / part["pred_s"].sum()
        for kind in STEP_KINDS:
            k = part[part["kind"] == kind]
            if len(k):
                pred, real = k["pred_s"].sum(), k["latency_s"].sum()
                rows.append({"trace": trace, "run": run, "kind": kind, "steps": len(k),
                             "real_s": real, "pred_s": pred, "err": pred / real - 1,
                             "err_own_speed": pred * speed / real - 1})  # fmt: skip
    return pd.DataFrame(rows)


CONTEXT_EDGES = (128, 256, 512, 1024, 1536, 2048, 4096, 8192, np.inf)


def decode_table(steps: pd.DataFrame, least: int = 100) -> pd.DataFrame:
    """Plain decode steps' error by batch size (4 = 4 or more) and longest
    context (``max_kv`` up to each edge), groups of at least ``least`` steps."""
    dec = steps[~steps["prefill"]]
    edge = np.searchsorted(np.asarray(CONTEXT_EDGES), dec["max_kv"].to_numpy(float), side="left")
    dec = dec.assign(
        batch=dec["num_reqs"].clip(upper=4).astype(int),
        context=[f"<={CONTEXT_EDGES[min(i, len(CONTEXT_EDGES) - 1)]:g}" for i in edge],
        order=edge,
    )
    table = dec.groupby(["trace", "batch", "order", "context"]).agg(
        steps=("pred_s", "size"), pred_s=("pred_s", "sum"), real_s=("latency_s", "sum")
    )
    table = table.reset_index().drop(columns="order")
    table["err"] = table["pred_s"] / table["real_s"] - 1
    return table[table["steps"] >= least].reset_index(drop=True)


def affine(steps: pd.DataFrame) -> dict:
    """``measured = a * predicted + b`` in relative least squares, and the plain ratio."""
    pred = steps["pred_s"].to_numpy(float)
    real = steps["latency_s"].to_numpy(float)
    weight = 1.0 / pred
    design = np.column_stack([pred, np.ones_like(pred)]) * weight[:, None]
    (a, b), *_ = np.linalg.lstsq(design, real * weight, rcond=None)
    return {"a": float(a), "b_ms": float(1e3 * b), "ratio": float(real.sum() / pred.sum())}


def shape(steps: pd.DataFrame) -> dict:
    """The model's error on one trace's steps in total, and the two level-free
    ratios a change of the machine's speed leaves alone (``error_ratio``): steps
    with a prefill chunk against plain decodes (``split``), decodes of 1-2
    requests against those of 4 or more (``small_vs_large``)."""

    def total(part: pd.DataFrame) -> float:
        return step_errors(part)["step_err_total"] if len(part) else np.nan

    errors = step_errors(steps)
    decodes = steps[~steps["prefill"]]
    small, large = (
        total(decodes[decodes["num_reqs"] <= 2]),
        total(decodes[decodes["num_reqs"] >= 4]),
    )
    return {
        "err_total": errors["step_err_total"],
        "split": error_ratio(
            errors.get("step_err_prefill_total", np.nan),
            errors.get("step_err_decode_total", np.nan),
        ),
        "small_vs_large": error_ratio(small, large),
    }


def compare(profiles: list[Path], runs: list[Path]) -> pd.DataFrame:
    """:func:`shape` of every trace's runs under each profile, one row per pair."""
    rows = []
    for path in profiles:
        model = ProfileModel(path)
        every = pd.concat([run_steps(run, model) for run in runs], ignore_index=True)
        for trace, steps in every.groupby("trace", sort=False):
            rows.append({"profile": str(path), "fit": model.fit_rel_error, "trace": trace,
                         **shape(steps)})  # fmt: skip
    return pd.DataFrame(rows)


def residuals_markdown(
    gaps: pd.DataFrame,
    decodes: pd.DataFrame,
    fits: pd.DataFrame,
    compared: pd.DataFrame | None,
    kinds: pd.DataFrame | None = None,
) -> str:
    """The kind, gap, decode, affine and (with ``--compare``) per-profile tables as
    Markdown."""
    text = ""
    if kinds is not None and len(kinds):
        text += "Predicted over measured busy time, less 1, by step kind (and at the run's "
        text += "own speed):\n\n"
        text += markdown_table(
            ["trace", "run", "kind", "steps", "measured (s)", "error", "at own speed"],
            [[r.trace, r.run, r.kind, str(r.steps), f"{r.real_s:.2f}", f"{r.err:+.1%}",
              f"{r.err_own_speed:+.1%}"] for r in kinds.itertuples()],
            left=3,
        )  # fmt: skip
        text += "\n"
    text += "Predicted over measured busy time, less 1, by the idle gap before each step:\n\n"
    text += markdown_table(
        ["trace", "kind", "gap", "steps", "error"],
        [[r.trace, r.kind, r.gap, str(r.steps), f"{r.err:+.1%}"] for r in gaps.itertuples()],
        left=3,
    )
    text += "\nPlain decode steps by batch size (4: 4 or more) and longest context:\n\n"
    text += markdown_table(
        ["trace", "batch", "context", "steps", "error"],
        [
            [r.trace, str(r.batch), r.context, str(r.steps), f"{r.err:+.1%}"]
            for r in decodes.itertuples()
        ],
        left=3,
    )
    text += "\nEach run as measured = a * predicted + b (relative least squares):\n\n"
    text += markdown_table(
        ["trace", "run", "a", "b (ms)", "measured / predicted"],
        [
            [r.trace, r.run, f"{r.a:.3f}", f"{r.b_ms:+.2f}", f"{r.ratio:.3f}"]
            for r in fits.itertuples()
        ],
        left=2,
    )
    if compared is not None:
        text += "\nThe same runs under each profile (level-free ratios, less 1):\n\n"
        text += markdown_table(
            ["profile", "fit", "trace", "total", "prefill vs decode", "1-2 vs 4+ decodes"],
            [[r.profile, f"{r.fit:.1%}", r.trace, f"{r.err_total:+.1%}", f"{r.split:+.1%}",
              f"{r.small_vs_large:+.1%}"] for r in compared.itertuples()],
            left=3,
        )  # fmt: skip
    return text


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="real run directories")
    ap.add_argument("--profile", type=Path, required=True, help="profile table the runs used")
    ap.add_argument("--out", type=Path, default=ROOT / "outputs/step_residuals")
    ap.add_argument(
        "--compare", nargs="*", type=Path, default=[],
        help="more profile tables: each one's total error, prefill/decode split and "
        "small/large decode batches on the same runs (compare.csv)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    model = ProfileModel(args.profile)
    steps = [run_steps(run, model) for run in args.runs]
    every = pd.concat(steps, ignore_index=True)
    tables = dict(
        kinds=kind_table(every),
        gaps=gap_table(every),
        decodes=decode_table(every),
        affine=pd.DataFrame(
            [
                {"trace": s["trace"].iloc[0], "run": s["run"].iloc[0], **affine(s)}
                for s in steps
                if len(s)
            ]
        ),
    )
    if args.compare:
        tables["compare"] = compare([args.profile, *args.compare], args.runs)
    text = residuals_markdown(tables["gaps"], tables["decodes"], tables["affine"],
                              tables.get("compare"), tables["kinds"])  # fmt: skip
    print(text, end="")
    args.out.mkdir(parents=True, exist_ok=True)
    for name, table in tables.items():
        table.to_csv(args.out / f"{name}.csv", index=False)
    (args.out / "step_residuals.md").write_text(text)
    write_manifest(args.out, profiles=[args.profile, *args.compare])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
