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

The data behind the tables is also embedded as JSON (``<script
id="dashboard-data">``), which the tests read back.
"""

from __future__ import annotations

import html
import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from testbed.report.stats import estimate, separated
from testbed.report.sweep import (
    TARGETS,
    fidelity_pairs,
    job_order,
    job_overrides,
    pair_key,
    settings,
)

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
CDF_POINTS = 200  # quantiles kept per CDF line
# Where seeds vary little (a trace's own arrivals, its tenants drawn anew), tiny gaps
# separate too: the summary counts pairs at least this far apart (relative)
MIN_GAP = 0.05
DASHBOARD = "dashboard.html"


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


# --- tables ---


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
        groups[(row["peers"], _at(row["x"]))].append(row)
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
        [peers, _label(x), totals[(peers, x)], *(c.get(k, 0) for k in keys)]
        for (peers, x), c in sorted(counts.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0))
    ]
    table = html_table(
        ["setting", x_title, "policy pairs", *(METRICS[k] for k in keys)],
        rows,
        [[_key(v) for v in row] for row in rows],
    )
    items = "".join(
        f"<li>{html.escape(f['peers'])}, {x_title} {_label(f['x'])}, {METRICS[f['metric']]}: "
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


# --- figures ---


def _at(x: float) -> float | None:
    """A load as a grouping key (None where a run has none)."""
    return None if math.isnan(x) else round(x, 9)


def _label(x: float | None) -> str:
    return "-" if x is None else f"{x:g}"


def _colors(series: list[str]) -> dict[str, str]:
    """A colour per series, by its policy (a series' first part), so that a policy
    keeps its colour across the figures of a page."""
    import plotly.express as px

    palette = px.colors.qualitative.Plotly + px.colors.qualitative.Dark24
    policies = sorted({_policy(s) for s in series})
    return {s: palette[policies.index(_policy(s)) % len(palette)] for s in series}


def _policy(series: str) -> str:
    """The legend's name of a series in a figure of one setting: its policy."""
    return series.split(" | ")[0]


def latency_figure(rows: list[dict[str, Any]], x_title: str, heading: str = ""):
    """Latency and goodput against load, one line per series, error bars from
    the intervals."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    panels = (*CURVES, "goodput_req_s")
    fig = make_subplots(
        rows=2,
        cols=3,
        subplot_titles=[
            METRICS[k] + (" (req/s)" if k == "goodput_req_s" else " (s)") for k in panels
        ],
    )
    series = list(dict.fromkeys(r["series"] for r in rows))
    colors = _colors(series)
    for s in series:
        points = sorted((r for r in rows if r["series"] == s), key=lambda r: r["x"])
        for i, key in enumerate(panels):
            est = [p[key] for p in points]
            fig.add_trace(
                go.Scatter(
                    x=[p["x"] for p in points],
                    y=[e.mean for e in est],
                    error_y=dict(
                        type="data",
                        symmetric=False,
                        array=[e.hi - e.mean for e in est],
                        arrayminus=[e.mean - e.lo for e in est],
                    ),
                    mode="lines+markers",
                    name=_policy(s),
                    legendgroup=s,
                    showlegend=i == 0,
                    line=dict(color=colors[s]),
                ),
                row=i // 3 + 1,
                col=i % 3 + 1,
            )
    fig.update_xaxes(title_text=x_title)
    for i in range(len(CURVES)):  # latencies span orders of magnitude past capacity
        fig.update_yaxes(type="log", row=i // 3 + 1, col=i % 3 + 1)
    fig.update_layout(
        height=620,
        title=f"{heading}: latency (log scale) and goodput against load (mean and 95% CI, "
        "or spread under 5 seeds)",
    )
    return fig


def _f4(values) -> np.ndarray:
    """A plotted series as 4-byte floats (plotly embeds numpy arrays as base64: half
    the bytes of 8-byte ones, and far fewer than JSON text)."""
    return np.asarray(values, dtype=np.float32)


def _quantiles(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    values = np.sort(values[~np.isnan(values)])
    if values.size == 0:
        return values, values
    q = np.linspace(0, 1, min(CDF_POINTS, values.size))
    return np.quantile(values, q), q


def _dropdown(fig, labels: list[str], members: list[list[int]], title: str) -> None:
    """A menu over ``labels``; each shows the traces ``members`` lists."""
    n = len(fig.data)
    buttons = []
    for label, shown in zip(labels, members, strict=True):
        visible = [False] * n
        for i in shown:
            visible[i] = True
        buttons.append(dict(label=label, method="update", args=[{"visible": visible}]))
    for i in range(n):
        fig.data[i].visible = i in set(members[-1]) if members else True
    fig.update_layout(
        updatemenus=[
            dict(
                buttons=buttons,
                active=len(buttons) - 1,
                x=1,
                xanchor="right",
                y=1.22,
                yanchor="bottom",
            )
        ],
        annotations=[
            *fig.layout.annotations,
            dict(
                text=title,
                x=0.8,
                y=1.24,
                xref="paper",
                yref="paper",
                showarrow=False,
                xanchor="right",
                yanchor="bottom",
            ),
        ],
        margin=dict(t=130),
    )


def cdf_figure(runs: list[Run], x_title: str, heading: str = ""):
    """TTFT, TPOT and E2E CDFs per series, pooled over seeds, one load at a time."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=3, subplot_titles=["TTFT (s)", "TPOT (s)", "E2E (s)"])
    series = list(dict.fromkeys(r.series for r in runs))
    colors = _colors(series)
    by_x: dict[float, list[int]] = defaultdict(list)
    for x in dict.fromkeys(_at(r.x) for r in sorted(runs, key=lambda r: r.x)):
        for s in series:
            members = [r for r in runs if r.series == s and _at(r.x) == x]
            frames = [_requests(r) for r in members]
            frames = [f for f in frames if f is not None]
            if not frames:
                continue
            pooled = pd.concat(frames)
            for i, col in enumerate(("ttft_s", "tpot_s", "e2e_s")):
                v, q = _quantiles(pooled[col].to_numpy(float))
                by_x[x].append(len(fig.data))
                fig.add_trace(
                    go.Scatter(
                        x=_f4(v), y=_f4(q), mode="lines", name=_policy(s), legendgroup=s,
                        showlegend=i == 0,
                        line=dict(color=colors[s]),
                    ),
                    row=1,
                    col=i + 1,
                )  # fmt: skip
    fig.update_yaxes(title_text="fraction of requests", col=1)
    fig.update_layout(
        height=420, title=f"{heading}: latency CDFs per policy (requests pooled over seeds)"
    )
    if by_x:
        _dropdown(fig, [f"{x_title} {_label(x)}" for x in by_x], list(by_x.values()), "at")
    return fig


def _requests(run: Run) -> pd.DataFrame | None:
    path = run.folder / "requests.csv"
    if not path.exists():
        return None
    return pd.read_csv(
        path, usecols=lambda c: c in ("tenant", "status", "ttft_s", "tpot_s", "e2e_s")
    )


def fairness_figure(runs: list[Run], rows: list[dict[str, Any]], x_title: str, heading: str = ""):
    """Jain's index over tenants against load per series; each tenant's mean TTFT
    per series at each load (a menu picks the load)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(
        rows=1,
        cols=2,
        subplot_titles=["Jain's index over tenants' 1 / mean TTFT", "mean TTFT per tenant (s)"],
    )
    series = list(dict.fromkeys(r["series"] for r in rows))
    colors = _colors(series)
    for s in series:
        points = sorted((r for r in rows if r["series"] == s), key=lambda r: r["x"])
        est = [p["tenant_ttft_jain"] for p in points]
        fig.add_trace(
            go.Scatter(
                x=[p["x"] for p in points], y=[e.mean for e in est], mode="lines+markers",
                name=_policy(s), legendgroup=s, line=dict(color=colors[s]),
                error_y=dict(type="data", symmetric=False, array=[e.hi - e.mean for e in est],
                             arrayminus=[e.mean - e.lo for e in est]),
            ),
            row=1, col=1,
        )  # fmt: skip
    fixed = len(fig.data)
    by_x: dict[float, list[int]] = defaultdict(list)
    for x in dict.fromkeys(_at(r.x) for r in sorted(runs, key=lambda r: r.x)):
        for s in series:
            members = [r for r in runs if r.series == s and _at(r.x) == x]
            tenants: dict[str, list[float]] = defaultdict(list)
            for r in members:
                for t, stats in (r.metrics.get("per_tenant") or {}).items():
                    tenants[t].append(stats.get("ttft_s_mean"))
            if not tenants:
                continue
            names = sorted(tenants)
            est = [estimate(tenants[t]) for t in names]
            by_x[x].append(len(fig.data))
            fig.add_trace(
                go.Bar(
                    x=names, y=[e.mean for e in est], name=_policy(s), legendgroup=s,
                    showlegend=False,
                    marker_color=colors[s],
                    error_y=dict(type="data", symmetric=False, array=[e.hi - e.mean for e in est],
                                 arrayminus=[e.mean - e.lo for e in est]),
                ),
                row=1, col=2,
            )  # fmt: skip
    fig.update_xaxes(title_text=x_title, col=1)
    fig.update_layout(height=420, barmode="group", title=f"{heading}: fairness across tenants")
    if by_x:
        labels = [f"{x_title} {_label(x)}" for x in by_x]
        _dropdown(fig, labels, [list(range(fixed)) + v for v in by_x.values()], "tenants at")
    return fig


TIMELINE_POINTS = 200  # per series and run in the dashboard (timeline.csv has 500)


def timeline_figure(runs: list[Run]):
    """Queue length, running requests and KV usage over time, one run at a time:
    each condition's first seed (its others differ in the draw alone), each
    series thinned to :data:`TIMELINE_POINTS`, so that a sweep of hundreds of
    runs stays a page of a few MB."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(
        rows=3,
        cols=1,
        shared_xaxes=True,
        subplot_titles=["waiting requests", "running requests", "KV usage"],
    )
    labels, members, seen = [], [], set()
    for r in runs:
        path = r.folder / "timeline.csv"
        if r.condition in seen or not path.exists():
            continue
        seen.add(r.condition)
        t = pd.read_csv(path)
        if len(t) > TIMELINE_POINTS:
            t = t.iloc[np.linspace(0, len(t) - 1, TIMELINE_POINTS).round().astype(int)]
        shown = []
        for i, col in enumerate(("num_waiting", "num_running", "kv_usage")):
            shown.append(len(fig.data))
            fig.add_trace(
                go.Scatter(
                    x=_f4(t["time_s"]), y=_f4(t[col]), mode="lines", name=col, showlegend=False
                ),
                row=i + 1,
                col=1,
            )
        labels.append(r.name)
        members.append(shown)
    fig.update_xaxes(title_text="time (s)", row=3, col=1)
    fig.update_layout(height=600, title="Queue and KV usage over time (binned)")
    if members:
        _dropdown(fig, labels, members, "run")
    return fig


def fidelity_section(runs: list[Run]) -> tuple[Any, str] | None:
    """Each simulation against its real run: a scatter per target metric and the
    error table; None without sim/real pairs."""
    table_runs = [
        {"run": r.name, "mode": r.metrics["mode"], "partial": bool(r.metrics.get("partial")),
         "pair": pair_key(job_overrides(r.folder), r.metrics), "own": True,
         **{k: r.metrics.get(k) for k in (*TARGETS, "speed_vs_profile")}}
        for r in runs
    ]  # fmt: skip
    pairs = fidelity_pairs(table_runs)
    if not pairs:
        return None
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    by_name = {t["run"]: t for t in table_runs}
    fig = make_subplots(rows=1, cols=len(TARGETS), subplot_titles=list(TARGETS))
    for i, metric in enumerate(TARGETS):
        real = [by_name[p["real"]][metric] for p in pairs]
        sim = [by_name[p["sim"]][metric] for p in pairs]
        top = max([v for v in real + sim if v is not None] or [1])
        fig.add_trace(
            go.Scatter(
                x=real, y=sim, mode="markers", text=[p["sim"] for p in pairs], showlegend=False
            ),
            row=1,
            col=i + 1,
        )
        fig.add_trace(
            go.Scatter(
                x=[0, top],
                y=[0, top],
                mode="lines",
                line=dict(dash="dot", color="grey"),
                showlegend=False,
            ),
            row=1,
            col=i + 1,
        )
    fig.update_xaxes(title_text="real")
    fig.update_yaxes(title_text="simulated", col=1)
    fig.update_layout(height=380, title="Simulation against the real run")
    headings = [
        "sim",
        "real",
        *(f"{m} error" for m in TARGETS),
        "real's speed vs profile",
        "within targets",
    ]
    rows = [
        [p["sim"], p["real"], *(p.get(m) for m in TARGETS), p["speed_vs_profile"], p["meets"]]
        for p in pairs
    ]
    return fig, html_table(headings, rows, [[_key(v) for v in row] for row in rows])


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
    fidelity = fidelity_section(runs)
    if fidelity is not None:
        figures.append(("Simulation against real runs", fidelity[0]))
        tables.insert(0, ("Simulation against real runs: errors", fidelity[1]))
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
