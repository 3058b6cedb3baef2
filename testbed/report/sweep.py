"""A sweep's summary: once ``python run.py -m ...`` has run every job, one table.

Hydra's callback (``testbed/report/sweep_callback.py``) calls
:func:`write_summary` after every job and at the end of a multirun. It reads
each job's ``metrics.json`` under the sweep directory, prints a line per run
and writes them to ``sweep_summary.csv`` there. Two checks a sweep needs:

* jobs that differ only in ``mode`` and its fields (``-m mode=sim,real ...``)
  are paired, and the simulation's relative error against the real run is
  printed for the fidelity targets (both as :mod:`testbed.metrics.fidelity`
  defines them) (throughput, mean TPOT and E2E, p50 TTFT),
  beside the real run's speed against the profile: the simulation runs at the
  profile's speed, so on a machine that moved the error is partly the machine's
  (``python -m experiments.fidelity`` separates the two);
* real runs whose steps took different multiples of their profile's prediction
  (``speed_vs_profile``, see :func:`testbed.sim.run_speed.speed_against`) are
  flagged: on a shared machine, what separates two real runs is partly the
  machine, not the policy.

The table holds this sweep's own jobs (each run folder's claim names its
sweep, :func:`testbed.report.rundir.claim`): another sweep writing into the same
``hydra.sweep.dir`` at the same time adds nothing to it. A simulation may still
pair with a real run of an earlier sweep there (marked as such). A job that
failed is listed with its error, and the summary is rewritten after every job,
so that a sweep stopped by a failing job still has one for the jobs that ran.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Sequence
from operator import itemgetter
from pathlib import Path
from typing import Any

from testbed.metrics.fidelity import TARGETS, metric_errors, pair_key, pair_runs, target_misses
from testbed.report.rundir import read_claim

# metrics.json keys the summary keeps, with their column headings
COLUMNS = {
    "mode": "mode",
    "policy": "policy",
    "trace": "trace",
    "num_finished": "finished",
    "num_rejected": "rejected",
    "throughput_req_s": "req/s",
    "ttft_s_p50": "TTFT p50",
    "tpot_s_mean": "TPOT mean",
    "e2e_s_mean": "E2E mean",
    "speed_vs_profile": "speed vs profile",
}
# Real runs whose speed_vs_profile differs by more than this are flagged
SPEED_SPREAD = 0.05


def job_order(run_dir: Path) -> tuple[int, str]:
    """Hydra's job number where the directory starts with it, then the name."""
    number = re.match(r"\d+", run_dir.name)
    return (int(number.group()) if number else 1 << 62, run_dir.name)


def job_overrides(run_dir: Path) -> list[str] | None:
    """The job's command-line overrides (Hydra's ``.hydra/overrides.yaml``); None
    where Hydra did not keep them (``hydra.output_subdir=null``)."""
    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return None
    import yaml

    return [str(o) for o in yaml.safe_load(path.read_text()) or []]


FAILED = "failed.json"  # a failed job's error and sweep, in its folder


# Rows read so far, by run folder, with the version of its metrics.json they came
# from: a sweep's summary is rewritten after every job, and rereading every
# finished job's files each time would grow with the square of the jobs.
_ROWS: dict[Path, tuple[tuple[int, int], dict[str, Any]]] = {}


def run_row(run_dir: Path) -> dict[str, Any] | str:
    """A job's row (see :func:`sweep_runs`), or why its ``metrics.json`` could not be
    read."""
    path = run_dir / "metrics.json"
    try:
        stat = path.stat()
    except OSError as err:
        return f"{path}: {err}"
    version = (stat.st_mtime_ns, stat.st_size)
    known = _ROWS.get(run_dir)
    if known is not None and known[0] == version:
        return known[1]
    try:
        metrics = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        return f"{path}: {err}"
    if not isinstance(metrics, dict):
        return f"{path}: not a JSON object"
    overrides = job_overrides(run_dir)
    row = {
        "run": run_dir.name,
        **{key: metrics.get(key) for key in COLUMNS},
        "partial": bool(metrics.get("partial")),
        "pair": pair_key(overrides, metrics),
        "settings": settings(overrides or []),
    }
    _ROWS[run_dir] = (version, row)
    return row


def sweep_runs(sweep_dir: Path, sweep: str | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """Every job under ``sweep_dir`` that wrote a ``metrics.json``, in job order: the
    :data:`COLUMNS`, ``partial``, its directory's name (``run``), its
    :func:`pair_key` (``pair``) and whether it is of the sweep ``sweep`` (``own``;
    every job where ``sweep`` is None); and the ``metrics.json`` files that could
    not be read, each with the reason (a job killed while writing it)."""
    runs, unread = [], []
    for run_dir in sorted((p.parent for p in sweep_dir.glob("*/metrics.json")), key=job_order):
        own = sweep is None or read_claim(run_dir).get("sweep") == sweep
        row = run_row(run_dir)
        if isinstance(row, str):
            if own:
                unread.append(row)
            continue
        runs.append({**row, "own": own})
    return runs, unread


def failed_jobs(sweep_dir: Path, sweep: str | None = None) -> list[dict[str, Any]]:
    """The jobs of the sweep ``sweep`` that failed: each one's folder (``run``), its
    error (``failed``) and its overrides (``settings``)."""
    failed = []
    for path in sorted(sweep_dir.glob(f"*/{FAILED}"), key=lambda p: job_order(p.parent)):
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            record = {"error": "(its record cannot be read)"}
        if sweep is None or record.get("sweep") == sweep:
            overrides = job_overrides(path.parent) or []
            failed.append({
                "run": path.parent.name,
                "failed": str(record.get("error")),
                "settings": settings(overrides),
            })  # fmt: skip
    return failed


# The comparisons a sweep over modes makes: (the run judged, its reference).
COMPARISONS = (("sim", "real"), ("sim", "vllm"), ("real", "vllm"))


def fidelity_pairs(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run against its reference of the same :func:`pair_key` (see
    :func:`~testbed.metrics.fidelity.pair_runs`), for each of :data:`COMPARISONS`:
    a simulation against the real run and against vLLM's, this project's engine
    against vLLM. Each pair: ``run`` and ``reference`` (their folders), ``modes``
    (``"sim vs real"``), the relative error of every :data:`TARGETS` metric both
    measured, the reference's ``speed_vs_profile`` (the simulation runs at the
    profile's speed unless ``mode.latency_scale`` says otherwise), and ``meets``:
    all within their targets; None where either run is partial (a stopped run is
    no measure of the other)."""
    pairs = []
    for model, reference in COMPARISONS:
        for run, ref in pair_runs(runs, itemgetter("pair"), itemgetter("mode"), model, reference):
            if not (run.get("own", True) or ref.get("own", True)):
                continue
            errors = metric_errors(run, ref, TARGETS)
            errors = {m: e for m, e in errors.items() if not math.isnan(e)}
            pairs.append({
                "run": run["run"] + ("" if run.get("own", True) else " (earlier sweep)"),
                "reference": ref["run"] + ("" if ref.get("own", True) else " (earlier sweep)"),
                "modes": f"{model} vs {reference}",
                **errors,
                "speed_vs_profile": ref.get("speed_vs_profile"),
                "meets": None if run["partial"] or ref["partial"] else not target_misses(errors),
            })  # fmt: skip
    return pairs


def speed_spread(runs: list[dict[str, Any]]) -> tuple[float, float] | None:
    """The lowest and highest ``speed_vs_profile`` of the real runs, where two or
    more have one."""
    speeds = [r["speed_vs_profile"] for r in runs if r["mode"] == "real"]
    speeds = [s for s in speeds if s is not None]
    return (min(speeds), max(speeds)) if len(speeds) >= 2 else None


def settings(overrides: list[str]) -> dict[str, str]:
    """A job's overrides as key -> value (``+``/``~`` prefixes dropped)."""
    return dict(o.lstrip("+~").partition("=")[::2] for o in overrides)


def swept_keys(runs: list[dict[str, Any]]) -> list[str]:
    """The override keys whose values differ between the runs (what the sweep
    varied), in the order they first appear; not those the summary has columns for."""
    keys = dict.fromkeys(k for r in runs for k in r.get("settings", {}))
    return [k for k in keys if k not in COLUMNS and len({overridden(r, k) for r in runs}) > 1]


def overridden(run: dict[str, Any], key: str) -> str:
    """The run's value of an override key ('-' where it does not set it)."""
    return run.get("settings", {}).get(key, "-")


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def percent(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"


def met(meets: bool | None) -> str:
    return "partial run" if meets is None else "met" if meets else "missed"


def table(headings: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headings)]
    lines = [headings, *rows]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines
    )


def summary(
    runs: list[dict[str, Any]],
    unread: Sequence[str] = (),
    failed: Sequence[dict[str, Any]] = (),
) -> str:
    """The printed summary: the sweep's own runs, then the sim-vs-real pairs, the
    speed check, the jobs that failed and the ``metrics.json`` files that could
    not be read."""
    own = [r for r in runs if r.get("own", True)]
    swept = swept_keys(own)
    headings = ["run", *swept, *COLUMNS.values()]
    rows = [
        [r["run"] + (" (partial)" if r["partial"] else "")]
        + [overridden(r, k) for k in swept]
        + [cell(r[k]) for k in COLUMNS]
        for r in own
    ]
    parts = [table(headings, rows)] if own else []
    pairs = fidelity_pairs(runs)
    if pairs:
        heads = ["run", "against", *(f"{COLUMNS[m]} err" for m in TARGETS)]
        heads += ["reference's speed vs profile", "targets"]
        lines = [
            [p["run"], p["reference"], *(percent(p.get(m)) for m in TARGETS)]
            + [cell(p["speed_vs_profile"]), met(p["meets"])]
            for p in pairs
        ]
        limits = ", ".join(f"{COLUMNS[m]} {t:.0%}" for m, t in TARGETS.items())
        parts.append(
            f"each run against its reference: simulation against the real run and "
            f"vLLM's, this engine against vLLM ({limits}; a real run whose machine ran "
            "slower or faster than profiled is off by as much, unless simulated at "
            "mode.latency_scale=<its speed vs profile>):\n" + table(heads, lines)
        )
    spread = speed_spread(own)
    if spread is not None and spread[1] / spread[0] - 1 > SPEED_SPREAD:
        low, high = spread
        parts.append(
            f"WARNING: the real runs' steps took {low:.3f}x to {high:.3f}x the time their "
            f"profile predicts ({high / low - 1:.1%} apart): on a shared machine that is "
            "mostly the machine's speed moving between runs (or the profile fitting some "
            "runs' step mixes worse than others'), so what separates these runs is partly "
            "not what the sweep varied. Repeat the sweep (in another order) to see how "
            "much, or compare the policies in simulation."
        )
    parts += [f"FAILED {f['run']}: {f['failed']}" for f in failed]
    parts += [f"not read: {u}" for u in unread]
    return "\n\n".join(parts)


def write_summary(sweep_dir: Path, sweep: str | None = None) -> str | None:
    """Write ``sweep_summary.csv`` under ``sweep_dir`` (the jobs of the sweep
    ``sweep``; every job there where it is None: a row per run, and a row per
    failed job with its error in ``failed``) and return the printed summary; None
    where no job wrote a ``metrics.json`` or failed (a sweep of profiles)."""
    runs, unread = sweep_runs(sweep_dir, sweep)
    failed = failed_jobs(sweep_dir, sweep)
    own = [r for r in runs if r["own"]]
    if not own and not unread and not failed:
        return None
    import pandas as pd

    rows = sorted([*own, *failed], key=lambda r: job_order(Path(r["run"])))
    if rows:
        swept = swept_keys(rows)
        frame = pd.DataFrame(rows, columns=["run", *COLUMNS, "partial", "pair", "failed"])
        for i, key in enumerate(swept):
            frame.insert(1 + i, key, [overridden(r, key) for r in rows])
        pairs = frame["pair"].map(lambda p: " ".join(p) if isinstance(p, tuple) else "")
        failed_as = frame["failed"].astype(object).where(frame["failed"].notna(), "")
        counts = {c: frame[c].astype("Int64") for c in ("num_finished", "num_rejected")}
        frame = frame.assign(pair=pairs, failed=failed_as, **counts)
        tmp = sweep_dir / f".sweep_summary.{os.getpid()}.csv"  # jobs in parallel rewrite it
        frame.to_csv(tmp, index=False)
        os.replace(tmp, sweep_dir / "sweep_summary.csv")
    return summary(runs, unread, failed)
