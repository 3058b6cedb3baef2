"""The sweep dashboard's figures (plotly): per setting, latency and goodput
against load with the intervals as error bars, latency CDFs per policy at each
load, fairness across tenants; queue and KV usage over time per run; and each
simulation against its real run."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import pandas as pd

from testbed.report.dashboard_data import CURVES, METRICS, Run, load_key, load_label
from testbed.report.stats import estimate
from testbed.report.sweep import TARGETS, fidelity_pairs, job_overrides, pair_key

CDF_POINTS = 200  # quantiles kept per CDF line


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
    for x in dict.fromkeys(load_key(r.x) for r in sorted(runs, key=lambda r: r.x)):
        for s in series:
            members = [r for r in runs if r.series == s and load_key(r.x) == x]
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
        _dropdown(fig, [f"{x_title} {load_label(x)}" for x in by_x], list(by_x.values()), "at")
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
    for x in dict.fromkeys(load_key(r.x) for r in sorted(runs, key=lambda r: r.x)):
        for s in series:
            members = [r for r in runs if r.series == s and load_key(r.x) == x]
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
        labels = [f"{x_title} {load_label(x)}" for x in by_x]
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


def fidelity_figure(runs: list[Run]) -> tuple[Any, list[dict[str, Any]]] | None:
    """Each run against its reference (a simulation against the real run or vLLM's,
    this engine against vLLM's): a scatter per target metric, a colour per
    comparison, and the pairs (``testbed.report.sweep.fidelity_pairs``); None
    without pairs."""
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
    comparisons = list(dict.fromkeys(p["modes"] for p in pairs))
    colors = _colors(comparisons)
    fig = make_subplots(rows=1, cols=len(TARGETS), subplot_titles=list(TARGETS))
    for i, metric in enumerate(TARGETS):
        values = []
        for modes in comparisons:
            these = [p for p in pairs if p["modes"] == modes]
            ref = [by_name[p["reference"]][metric] for p in these]
            run = [by_name[p["run"]][metric] for p in these]
            values += ref + run
            fig.add_trace(
                go.Scatter(
                    x=ref,
                    y=run,
                    mode="markers",
                    name=modes,
                    legendgroup=modes,
                    showlegend=i == 0 and len(comparisons) > 1,
                    marker=dict(color=colors[modes]),
                    text=[p["run"] for p in these],
                ),
                row=1,
                col=i + 1,
            )
        top = max([v for v in values if v is not None] or [1])
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
    fig.update_xaxes(title_text="reference (real engine, vLLM)")
    fig.update_yaxes(title_text="run (simulated, real engine)", col=1)
    fig.update_layout(height=380, title="Each run against its reference")
    return fig, pairs
