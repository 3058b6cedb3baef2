"""A sweep's runs as the dashboard compares them: each run folder's metrics and
settings, the conditions (runs that differ only in their seed) with every
metric's mean and interval over seeds (``testbed.report.stats``), and the policy
pairs whose intervals do not overlap."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from testbed.report.stats import estimate, separated
from testbed.report.sweep import job_order, job_overrides, settings

# metrics.json keys of the tables, with their headings
METRICS = {
    "throughput_req_s": "req/s",
    "ttft_s_p50": "TTFT p50",
    "ttft_s_p99": "TTFT p99",
    "tpot_s_mean": "TPOT mean",
    "tpot_s_p99": "TPOT p99",
    "e2e_s_mean": "E2E mean",
    "goodput_req_s": "goodput",
    "slo_attainment": "SLO att.",
    "tenant_service_jain": "Jain (service)",
    "tenant_ttft_jain": "Jain (TTFT)",
}
# The latency-throughput panels
CURVES = ("ttft_s_p50", "ttft_s_p99", "tpot_s_mean", "tpot_s_p99", "e2e_s_mean")
# Settings that are not what a condition compares: repeats and display
REPEAT_KEYS = ("seed", "trace.seed")
# Where a sweep varies the load, the x axis: the first of these it sets
LOAD_KEYS = ("load", "trace.rate")
# Where seeds vary little (a trace's own arrivals, its tenants drawn anew), tiny gaps
# separate too: the summary counts pairs at least this far apart (relative)
MIN_GAP = 0.05


@dataclass
class Run:
    """One run folder's metrics and where it stands in the sweep."""

    folder: Path
    name: str
    metrics: dict[str, Any]
    settings: dict[str, str]
    condition: tuple[str, ...] = ()
    series: str = ""  # the line it belongs to in a latency-load figure
    peers: str = ""  # its series but the policy: the runs a policy is compared with
    x: float = math.nan  # its load, or offered rate
    extra: dict[str, Any] = field(default_factory=dict)


def find_runs(root: Path) -> list[Run]:
    """Every run folder under ``root`` that wrote a readable ``metrics.json``, in
    job order (unreadable ones are skipped with a line on stderr)."""
    runs = []
    for path in sorted(root.rglob("metrics.json"), key=lambda p: job_order(p.parent)):
        if any(part in ("wandb", ".hydra") for part in path.parts):
            continue
        try:
            metrics = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            print(f"dashboard: skipping {path} ({e})")
            continue
        if not isinstance(metrics, dict) or "policy" not in metrics:
            continue
        overrides = job_overrides(path.parent) or []
        name = str(path.parent.relative_to(root)) if path.parent != root else root.name
        runs.append(Run(path.parent, name, metrics, settings(overrides)))
    return runs


def value(run: Run, key: str) -> str:
    """The run's setting ``key``: its override, else its metrics' value where they
    name it (``mode``, ``policy``, ``seed``...), else '-'."""
    if key in run.settings:
        return run.settings[key]
    return str(run.metrics[key]) if key in run.metrics else "-"


def _x_key(runs: list[Run]) -> str | None:
    for key in LOAD_KEYS:
        if len({value(r, key) for r in runs}) > 1:
            return key
    return None


def place(runs: list[Run]) -> str:
    """Give each run its condition, series and x; returns the x axis's title."""
    swept = [
        k for k in dict.fromkeys(k for r in runs for k in r.settings)
        if len({value(r, k) for r in runs}) > 1
    ]  # fmt: skip
    x_key = _x_key(runs)
    kept = [k for k in swept if k not in REPEAT_KEYS]
    for r in runs:
        r.condition = tuple(f"{k}={value(r, k)}" for k in kept)
        label = [r.metrics["policy"], r.metrics["trace"]]
        label += [f"{k}={value(r, k)}" for k in kept if k not in (x_key, "policy", "trace")]
        r.series = " | ".join(str(v) for v in label)
        r.peers = " | ".join(str(v) for v in label[1:])
        if x_key == "load":
            r.x = float(r.metrics.get("load") or r.settings["load"])
        elif x_key is not None:
            r.x = float(r.settings[x_key])
        else:
            r.x = float(r.metrics.get("load") or r.metrics.get("offered_req_s") or math.nan)
    xs: dict[tuple, list[float]] = defaultdict(list)
    for r in runs:  # seeds of a condition offer slightly different rates: one x for all
        xs[r.condition].append(r.x)
    for r in runs:
        r.x = (
            float(np.nanmean(xs[r.condition]))
            if not all(map(math.isnan, xs[r.condition]))
            else math.nan
        )
    return {"load": "load (fraction of capacity)", "trace.rate": "rate (req/s)"}.get(
        x_key or "", "load" if any(r.metrics.get("load") for r in runs) else "offered (req/s)"
    )


def conditions(runs: list[Run]) -> list[dict[str, Any]]:
    """Per condition: its series and x, how many seeds, and each :data:`METRICS`
    metric's estimate over them."""
    groups: dict[tuple, list[Run]] = defaultdict(list)
    for r in runs:
        groups[r.condition].append(r)
    rows = []
    for cond, members in groups.items():
        row = {
            "condition": " ".join(cond) or members[0].name,
            "series": members[0].series,
            "policy": members[0].metrics["policy"],
            "peers": members[0].peers,
            "x": members[0].x,  # one per condition (place)
            "seeds": len(members),
        }
        for key in METRICS:
            row[key] = estimate([m.metrics.get(key) for m in members])
        rows.append(row)
    return rows


def differences(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Among the conditions that differ only in policy (same trace, load and other
    settings), the pairs whose metric differs beyond both intervals, for the
    latency metrics and goodput: each with the lower and the higher."""
    found = []
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        groups[(row["peers"], load_key(row["x"]))].append(row)
    for (peers, x), group in groups.items():
        pairs = len(group) * (len(group) - 1) // 2
        for key in (*CURVES, "goodput_req_s"):
            for i, a in enumerate(group):
                for b in group[i + 1 :]:
                    if separated(a[key], b[key]):
                        lo, hi = sorted((a, b), key=lambda r: r[key].mean)
                        found.append({
                            "peers": peers, "x": x, "metric": key, "pairs": pairs,
                            "lower": lo["policy"], "lower_value": lo[key].text(),
                            "higher": hi["policy"], "higher_value": hi[key].text(),
                            "gap": hi[key].mean / lo[key].mean - 1 if lo[key].mean else math.inf,
                        })  # fmt: skip
    return found


def condition_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """:func:`conditions` as a table: per metric its mean, interval (``_lo``,
    ``_hi``) and the interval's kind (``ci95``, ``range`` or ``single``)."""
    out = []
    for row in rows:
        flat = {k: row[k] for k in ("condition", "series", "x", "seeds")}
        for key in METRICS:
            est = row[key]
            flat |= {key: est.mean, f"{key}_lo": est.lo, f"{key}_hi": est.hi}
        flat["interval"] = next((row[k].kind for k in METRICS if row[k].n), "single")
        out.append(flat)
    return pd.DataFrame(out)


def load_key(x: float) -> float | None:
    """A load as a grouping key (None where a run has none)."""
    return None if math.isnan(x) else round(x, 9)


def load_label(x: float | None) -> str:
    return "-" if x is None else f"{x:g}"
