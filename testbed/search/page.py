"""The deployment search's page, ``search.html`` beside the sweep's
``dashboard.html`` (the dashboard's page style, sortable tables and offline
plotly): the best configuration per SLO, per SLO the Pareto front of rate per
GPU against TTFT and TPOT over the simulations that met it, every
configuration's outcome and every simulation."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from testbed.report.dashboard import _CSS, _SORT_JS, _clean, _key, _scrolled, html_table
from testbed.search.search import Search

PAGE = "search.html"
STATUS_COLORS = {"converged": "#1f77b4", "pruned": "#aaaaaa", "unbounded": "#2ca02c",
                 "stopped": "#ff7f0e", "failed": "#d62728"}  # fmt: skip


def table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    """A sortable table of ``rows`` (every key of the first row, or ``columns``)."""
    if not rows:
        return "<p>None.</p>"
    columns = columns or list(rows[0])
    cells = [[r.get(c) for c in columns] for r in rows]
    return html_table(columns, cells, [[_key(v) for v in row] for row in cells])


def front_figure(search: Search, slo_name: str, front: list[dict[str, Any]]):
    """Rate per GPU against TTFT and TPOT (the SLO's percentile) of every run that
    met the SLO, coloured by how its configuration's search ended; the fronts
    as lines, the best as a star."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    slo = next(s for s in search.slos if s.name == slo_name)
    fig = make_subplots(
        rows=1, cols=2,
        subplot_titles=[f"TTFT {slo.percentile} (s)", f"TPOT {slo.percentile} (s)"],
    )  # fmt: skip
    by_status: dict[str, list] = {}
    for run in search.runs:
        if run.met.get(slo_name):
            status = search.intervals[(run.dep, slo_name)].status
            by_status.setdefault(status, []).append(run)
    for col, latency in enumerate(("ttft", "tpot"), start=1):
        for status, runs in sorted(by_status.items()):
            values = [slo.latencies(r.metrics)[col - 1] for r in runs]
            fig.add_trace(
                go.Scatter(
                    x=values,
                    y=[r.rate / search.deps[r.dep].gpus for r in runs],
                    mode="markers",
                    marker=dict(size=6, color=STATUS_COLORS.get(status, "#9467bd")),
                    name=f"runs of {status} configurations",
                    legendgroup=status,
                    showlegend=col == 1,
                    text=[f"{search.deps[r.dep].id}: {search.deps[r.dep].label}" for r in runs],
                    hovertemplate="%{text}<br>%{y:.4g} req/s/GPU at %{x:.4g} s<extra></extra>",
                )
            )
        points = [p for p in front if p["slo"] == slo_name and p["latency"] == f"{latency}_s"]
        fig.add_trace(
            go.Scatter(
                x=[p[f"{latency}_s"] for p in points],
                y=[p["rate_req_s_per_gpu"] for p in points],
                mode="lines+markers",
                line=dict(color="black", shape="hv"),
                name="Pareto front",
                legendgroup="front",
                showlegend=col == 1,
                text=[f"{p['config']}: {p['label']}" for p in points],
                hovertemplate="%{text}<br>%{y:.4g} req/s/GPU at %{x:.4g} s<extra></extra>",
            ),
            row=1,
            col=col,
        )
        fig.add_vline(x=getattr(slo, f"{latency}_s"), line_dash="dot", row=1, col=col)
        if points:
            fig.add_trace(
                go.Scatter(x=[points[0][f"{latency}_s"]], y=[points[0]["rate_req_s_per_gpu"]],
                           mode="markers", marker=dict(symbol="star", size=16, color="gold"),
                           name="best", legendgroup="best", showlegend=col == 1),
                row=1, col=col,
            )  # fmt: skip
    fig.update_yaxes(title_text="req/s per GPU", rangemode="tozero")
    fig.update_layout(height=420, title=slo.label)
    return fig


def write_page(
    out: Path,
    result: dict[str, Any],
    configs: list[dict[str, Any]],
    runs: list[dict[str, Any]],
    search: Search,
) -> Path:
    """Write ``search.html`` to ``out``; returns its path."""
    import plotly.io as pio
    from plotly.offline import get_plotlyjs

    n = result["counts"]
    per = result.get("requests_per_instance")
    requests = f"{per} requests an instance" if per else f"{result['num_requests']} requests"
    title = (
        f"Deployment search: {result['model']} on {result['hardware']}, trace "
        f"{result['trace']} ({requests}), {result['budget']} GPUs"
    )
    checked = ", ".join(f"{v} {k}" for k, v in n["checked_out"].items()) or "none"
    parts = [
        f"<p>{n['space']} configurations in the space; dropped before simulating: {checked}; "
        f"{n['searched']} searched under {n['slos']} SLOs; {n['simulations']} simulations "
        f"in {n['rounds']} rounds ({n['wall_s']:.1f} s). Latency floors: "
        f"{html.escape(str(result['latency_floors']))}. The sweep's runs: "
        "<a href='dashboard.html'>dashboard.html</a>.</p>",
        "<h2>Best configuration per SLO</h2>",
        table(result["best"]),
        "<h2>Which knobs mattered</h2><p>Per SLO, each value of a knob other than the "
        "best configuration's: the rate per GPU the configurations with it reach, as a "
        "fraction of the best's, at least (proven met) and at most (the search's bound: "
        "a miss, or 0 below a latency floor). <i>mattered</i>: even the most is below the "
        "best beyond the tolerance; <i>did not</i>: the least is within it; "
        "<i>unsettled</i>: pruned at the best's own rate, how far below is unknown.</p>",
        table(result["knob_effects"]),
    ]
    for slo in search.slos:
        fig = front_figure(search, slo.name, result["front"])
        parts += [
            f"<h2>{html.escape(slo.label)}: rate per GPU against latency</h2>",
            f"<p>The front covers: {html.escape(result['front_covers'][slo.name])}.</p>",
            pio.to_html(fig, full_html=False, include_plotlyjs=False),
        ]
    parts += [
        "<h2>Every configuration: how far its search got, and why it stopped</h2>",
        _scrolled(table(configs)),
        f"<details><summary>Every simulation ({len(runs)})</summary>",
        _scrolled(table(runs)),
        "</details>",
    ]
    payload = json.dumps(_clean(result), default=str).replace("</", "<\\/")
    page = (
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{_CSS}</style>"
        f"<script>{get_plotlyjs()}</script><script>{_SORT_JS}</script></head><body>"
        f"<h1>{html.escape(title)}</h1>"
        + "".join(parts)
        + f"<script type='application/json' id='search-data'>{payload}</script></body></html>"
    )
    path = out / PAGE
    path.write_text(page)
    return path
