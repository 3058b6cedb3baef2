"""Do real runs slow down as they pile up in one Python process?

Runs the same short real run (a fixed trace slice, one engine thread pinned to
``--engine-cpu``) ``--pairs`` times in fresh processes and as many times in this
one, alternately (fresh, here, fresh, here, ...: the machine's drift falls on
both alike), each beside a reference probe on ``--reference-cpu``
(``testbed.profiling.reference_probe``). For each run it reports

- ``own``: the run's busy time over the latency model's prediction of the same
  steps (fidelity's own-speed factor; the committed profile of the hardware),
- ``reference_ms``: the reference probe's median step beside the run's busy
  steps (the machine's speed, measured in another process on the other core),
- ``own_per_ref``: ``own`` over ``reference_ms``, as a share of the fresh runs'
  mean: how much slower the engine ran than the machine's speed says.

If a process's earlier runs leave state that slows its later ones (heap,
caches), the later runs here have ``own_per_ref`` above the fresh runs'. It
prints the table and writes it (CSV), a summary (JSON) and ``manifest.json`` to
``--out`` (``outputs/process_state``).

    python -m experiments.process_state --pairs 4
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd

from experiments.fidelity.compare import step_errors
from experiments.fidelity.execute import run_isolated
from experiments.fidelity.speeds import busy_steps, own_speed
from experiments.manifest import ROOT, write_manifest
from testbed.build import latency_model
from testbed.config_schema import compose_config
from testbed.job import run_from_config


def run_row(run: Path, model) -> dict:
    steps = busy_steps(run, model)
    metrics = json.loads((run / "metrics.json").read_text())
    if metrics.get("partial"):
        raise SystemExit(f"{run}: the run did not finish ({metrics.get('stop_reason')})")
    return dict(
        own=own_speed(step_errors(steps)),
        reference_ms=metrics["reference_probe_s"] * 1e3,
        steps=len(steps),
    )


def run_overrides(args: argparse.Namespace) -> list[str]:
    """One short real run: fcfs on a slice of Azure conv, one engine thread on
    ``--engine-cpu``, the reference probe on ``--reference-cpu``."""
    return [
        "logging=disabled",
        "progress=false",
        "plots=false",
        "hardware=cpu1",
        f"hardware.cpus=[{args.engine_cpu}]",
        f"hardware.reference_cpus=[{args.reference_cpu}]",
        "engine.max_num_seqs=8",
        "trace=azure_conv",
        f"trace.num_requests={args.num_requests}",
        f"trace.rate={args.rate}",
        "trace.max_model_len=2048",
        "policy=fcfs",
        *args.extra,
    ]


def summarize(table: pd.DataFrame) -> dict:
    """``own_per_ref`` of the fresh runs, of this process's first run and of its later ones."""
    fresh = table[table["process"] == "fresh"]["own_per_ref"]
    first = table[(table["process"] == "here") & (table["nth_here"] == 1)]["own_per_ref"]
    later = table[(table["process"] == "here") & (table["nth_here"] > 1)]["own_per_ref"]
    return dict(
        fresh_mean=fresh.mean(),
        fresh_sd=fresh.std(),
        here_first=float(first.iloc[0]),
        here_later_mean=later.mean(),
        here_later_sd=later.std(),
        later_over_fresh=later.mean() / fresh.mean() - 1,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=4, help="fresh runs, and runs in this process")
    ap.add_argument("--num-requests", type=int, default=50)
    ap.add_argument("--rate", type=float, default=0.3, help="req/s")
    ap.add_argument("--engine-cpu", type=int, default=1)
    ap.add_argument("--reference-cpu", type=int, default=0)
    ap.add_argument("--extra", nargs="*", default=[], help="more Hydra overrides")
    ap.add_argument("--out", type=Path, default=ROOT / "outputs/process_state", help="the table")
    ap.add_argument("--runs", type=Path, default=ROOT / "outputs/process_state", help="the runs")
    args = ap.parse_args()
    if args.pairs < 2:
        raise SystemExit("--pairs must be >= 2 (this process's later runs are the question)")
    args.out.mkdir(parents=True, exist_ok=True)
    overrides = run_overrides(args)
    model = latency_model(compose_config([*overrides, "mode=sim"]))
    rows = []
    for i in range(args.pairs):
        for where in ("fresh", "here"):
            run = args.runs / "runs" / f"{i + 1}-{where}"
            if where == "fresh":
                run_isolated([*overrides, "mode=real"], run)
            else:
                run_from_config(compose_config([*overrides, "mode=real"]), run)
            rows.append(
                dict(order=len(rows) + 1, process=where, nth_here=i + 1, **run_row(run, model))
            )
            print(rows[-1], flush=True)
    table = pd.DataFrame(rows)
    table.loc[table["process"] == "fresh", "nth_here"] = np.nan
    ratio = table["own"] / table["reference_ms"]
    table["own_per_ref"] = ratio / ratio[table["process"] == "fresh"].mean()
    summary = summarize(table)
    print(table.to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    print(json.dumps(summary, indent=1))
    table.to_csv(args.out / "process_state.csv", index=False, float_format="%.6g")
    (args.out / "process_state.json").write_text(
        json.dumps(dict(summary, overrides=overrides), indent=1) + "\n"
    )
    write_manifest(args.out, profiles=[model.path] if hasattr(model, "path") else [])


if __name__ == "__main__":
    main()
