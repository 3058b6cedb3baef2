"""A sweep's dashboard: one self-contained ``dashboard.html`` (plotly, its
JavaScript inlined: it opens offline, with no server).

What it shows, from the run folders under a sweep or results folder (each
``metrics.json`` with the ``requests.csv``, ``timeline.csv`` and Hydra overrides
beside it):

* the summary table, one row per run (sortable by clicking a heading), and
  the same metrics per condition (a condition: the runs that differ only in
  ``seed``) as the mean with its 95% interval, or the spread under five seeds
  (``testbed.report.stats``), with the pairs of policies that differ beyond
  their intervals;
* latency against offered load per policy (TTFT p50 and p99, TPOT mean and
  p99, E2E mean), with the intervals as error bars;
* TTFT, TPOT and E2E CDFs per policy at each load (a menu picks the load);
* fairness: Jain's index over tenants against load, and each tenant's mean
  TTFT per policy;
* queue length and KV usage over time for the run a menu picks;
* where the sweep ran ``mode=sim,real`` pairs, each simulation against its real
  run (``testbed.report.sweep.fidelity_pairs``): a scatter and the error table.

The runs and conditions come from ``dashboard_data.py``, the figures from
``dashboard_figures.py``. The data behind the tables is also embedded as JSON (``<script
id="dashboard-data">``), which the tests read back.
"""

from __future__ import annotations

import html
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from testbed.report.dashboard_data import (
    CURVES,
    METRICS,
    MIN_GAP,
    Run,
    condition_frame,
    conditions,
    differences,
    find_runs,
    load_label,
    place,
    value,
)
from testbed.report.dashboard_figures import (
    cdf_figure,
    fairness_figure,
    fidelity_figure,
    latency_figure,
    timeline_figure,
)
from testbed.report.sweep import TARGETS

DASHBOARD = "dashboard.html"


def differences_section(found: list[dict[str, Any]], x_title: str) -> str:
    """How many policy pairs separate, per setting, load and metric, then every
    pair (folded)."""
    if not found:
        return (
            "<p>None: no two policies' intervals separate at any load (or a single "
            "seed per condition states no variation).</p>"
        )
    counts: dict[tuple, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    totals: dict[tuple, int] = {}
    for f in found:
        totals[(f["peers"], f["x"])] = f["pairs"]
        if f["gap"] >= MIN_GAP:
            counts[(f["peers"], f["x"])][f["metric"]] += 1
    for key in totals:
        counts.setdefault(key, defaultdict(int))
    keys = [*CURVES, "goodput_req_s"]
    rows = [
        [peers, load_label(x), totals[(peers, x)], *(c.get(k, 0) for k in keys)]
        for (peers, x), c in sorted(counts.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0))
    ]
    table = html_table(
        ["setting", x_title, "policy pairs", *(METRICS[k] for k in keys)],
        rows,
        [[_key(v) for v in row] for row in rows],
    )
    items = "".join(
        f"<li>{html.escape(f['peers'])}, {x_title} {load_label(f['x'])}, {METRICS[f['metric']]}: "
        f"{html.escape(f['lower'])} {f['lower_value']} &lt; {html.escape(f['higher'])} "
        f"{f['higher_value']} (+{f['gap']:.1%})</li>"
        for f in found
    )
    return (
        "<p>Policy pairs whose intervals do not overlap and whose means are at least "
        f"{MIN_GAP:.0%} apart, per setting and load (of the pairs compared):</p>{table}"
        f"<details><summary>every pair whose intervals do not overlap ({len(found)}, "
        f"with how far apart)</summary><ul>{items}</ul></details>"
    )


def _cell(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def html_table(headings: list[str], rows: list[list[Any]], sort_keys: list[list[Any]]) -> str:
    """A table whose headings sort it (by ``sort_keys``, numbers as numbers)."""
    head = "".join(f"<th onclick='sortTable(this)'>{html.escape(h)}</th>" for h in headings)
    body = []
    for row, keys in zip(rows, sort_keys, strict=True):
        cells = "".join(
            f"<td data-key='{html.escape(json.dumps(k))}'>{html.escape(_cell(v))}</td>"
            for v, k in zip(row, keys, strict=True)
        )
        body.append(f"<tr>{cells}</tr>")
    rows_html = "".join(body)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{rows_html}</tbody></table>"


def _key(v: Any) -> Any:
    if isinstance(v, int | float) and not (isinstance(v, float) and math.isnan(v)):
        return v
    return None if v is None or isinstance(v, float) else str(v)


def run_table(runs: list[Run]) -> str:
    swept = list(dict.fromkeys(k for r in runs for k in r.settings))
    swept = [
        k for k in swept
        if k not in ("mode", "policy", "trace", "seed") and len({value(r, k) for r in runs}) > 1
    ]  # fmt: skip
    headings = ["run", "mode", "policy", "trace", *swept, "seed", *METRICS.values()]
    rows, keys = [], []
    for r in runs:
        m = r.metrics
        row = [r.name, m["mode"], m["policy"], m["trace"]]
        row += [value(r, k) for k in swept] + [m.get("seed")]
        row += [m.get(k) for k in METRICS]
        rows.append(row)
        keys.append([_key(v) for v in row])
    return html_table(headings, rows, keys)


def condition_table(rows: list[dict[str, Any]], x_title: str) -> str:
    headings = ["condition", "series", x_title, "seeds", *METRICS.values()]
    cells, keys = [], []
    for row in rows:
        cells.append([row["condition"], row["series"], row["x"], row["seeds"]] + [
            row[k].text() for k in METRICS
        ])  # fmt: skip
        keys.append([row["condition"], row["series"], _key(row["x"]), row["seeds"]] + [
            _key(row[k].mean) for k in METRICS
        ])  # fmt: skip
    return html_table(headings, cells, keys)


# --- the page ---

_SORT_JS = """
function sortTable(th) {
  const table = th.closest('table'), body = table.tBodies[0];
  const col = Array.from(th.parentNode.children).indexOf(th);
  const asc = th.dataset.order !== 'asc';
  th.parentNode.querySelectorAll('th').forEach(h => delete h.dataset.order);
  th.dataset.order = asc ? 'asc' : 'desc';
  const key = tr => JSON.parse(tr.children[col].dataset.key);
  Array.from(body.rows).sort((a, b) => {
    const x = key(a), y = key(b);
    if (x === null) return 1; if (y === null) return -1;
    return (x < y ? -1 : x > y ? 1 : 0) * (asc ? 1 : -1);
  }).forEach(tr => body.appendChild(tr));
}
"""
_CSS = """
body { font-family: sans-serif; margin: 1.5em; }
table { border-collapse: collapse; font-size: 13px; margin-bottom: 1em; }
th, td { border: 1px solid #ccc; padding: 3px 6px; text-align: right; }
th { background: #f0f0f0; cursor: pointer; position: sticky; top: 0; }
div.scroll { max-height: 480px; overflow: auto; margin-bottom: 1em; }
td:first-child, th:first-child { text-align: left; }
th[data-order=asc]::after { content: ' \\25B2'; } th[data-order=desc]::after { content: ' \\25BC'; }
"""


def fidelity_table(pairs: list[dict[str, Any]]) -> str:
    """The errors of each run against its reference (a simulation against the real
    run or vLLM's, this engine against vLLM's)."""
    headings = [
        "modes",
        "run",
        "reference",
        *(f"{m} error" for m in TARGETS),
        "reference's speed vs profile",
        "within targets",
    ]
    rows = [
        [p["modes"], p["run"], p["reference"], *(p.get(m) for m in TARGETS)]
        + [p["speed_vs_profile"], p["meets"]]
        for p in pairs
    ]
    return html_table(headings, rows, [[_key(v) for v in row] for row in rows])


def build(root: Path, title: str | None = None, conditions_csv: Path | None = None) -> str:
    """The dashboard's HTML for the runs under ``root``; also writes the
    per-condition table to ``conditions_csv`` where given."""
    import plotly.io as pio
    from plotly.offline import get_plotlyjs

    runs = find_runs(root)
    if not runs:
        raise ValueError(f"{root}: no run folder with a metrics.json under it")
    x_title = place(runs)
    rows = conditions(runs)
    if conditions_csv is not None:
        condition_frame(rows).to_csv(conditions_csv, index=False)
    found = differences(rows)
    head = [("Differences beyond the intervals", differences_section(found, x_title))]
    tables = [
        ("Per condition (over seeds)", _scrolled(condition_table(rows, x_title))),
        ("Runs", _scrolled(run_table(runs))),
    ]
    figures = []
    for peers in dict.fromkeys(r.peers for r in runs):  # a trace (and setting) at a time
        mine = [r for r in runs if r.peers == peers]
        rows_p = [row for row in rows if row["peers"] == peers]
        figures += [
            (f"{peers}: latency against load", latency_figure(rows_p, x_title, peers)),
            (f"{peers}: latency CDFs", cdf_figure(mine, x_title, peers)),
            (f"{peers}: fairness", fairness_figure(mine, rows_p, x_title, peers)),
        ]
    figures.append(("Over time", timeline_figure(runs)))
    fidelity = fidelity_figure(runs)
    if fidelity is not None:
        figures.append(("Simulation against real runs", fidelity[0]))
        tables.insert(0, ("Runs against their references: errors", fidelity_table(fidelity[1])))
    data = {
        "runs": [
            {
                "run": r.name,
                "series": r.series,
                "x": r.x,
                **{k: r.metrics.get(k) for k in ("mode", "policy", "trace", "seed", *METRICS)},
            }
            for r in runs
        ],
        "conditions": [
            {
                **{k: v for k, v in row.items() if k not in METRICS},
                **{k: row[k].__dict__ for k in METRICS},
            }
            for row in rows
        ],
        "differences": found,
    }
    parts = [f"<h2>{html.escape(h)}</h2>{body}" for h, body in head]
    for heading, fig in figures:
        parts.append(
            f"<h2>{html.escape(heading)}</h2>"
            + pio.to_html(fig, full_html=False, include_plotlyjs=False)
        )
    parts += [f"<h2>{html.escape(h)}</h2>{body}" for h, body in tables]
    title = title or f"Sweep {root.name}"
    payload = json.dumps(_clean(data)).replace("</", "<\\/")
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{_CSS}</style>"
        f"<script>{get_plotlyjs()}</script><script>{_SORT_JS}</script></head><body>"
        f"<h1>{html.escape(title)}</h1><p>{len(runs)} runs from {html.escape(str(root))}</p>"
        + "".join(parts)
        + f"<script type='application/json' id='dashboard-data'>{payload}</script></body></html>"
    )


def _scrolled(table: str) -> str:
    """A long table in a box of its own height (a sweep has hundreds of runs)."""
    return f"<div class='scroll'>{table}</div>"


def _clean(v: Any) -> Any:
    """``v`` as strict JSON takes it: NaN as null, numpy scalars as numbers."""
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_clean(x) for x in v]
    return v


CONDITIONS = "sweep_conditions.csv"


def write_dashboard(root: Path, out: Path | None = None, title: str | None = None) -> Path:
    """Write :func:`build`'s page to ``out`` (``root/dashboard.html``), and the
    per-condition table (means and intervals over seeds) beside it
    (:data:`CONDITIONS`)."""
    out = out or root / DASHBOARD
    out.write_text(build(root, title, out.parent / CONDITIONS))
    return out
