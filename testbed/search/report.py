"""The deployment search's results: the best configuration per SLO, the Pareto
front of rate per GPU against latency per SLO, every configuration's outcome
(how far it got and why it stopped) and every simulation, written to the sweep
folder as CSV and JSON, printed as a table, and drawn (``page.py``).

The front is drawn from the simulations that met the SLO: each a measured
operating point (a configuration at a rate), on the front where no other point
serves more per GPU at no more latency. A configuration pruned before any rate
met the SLO has no point; its rate per GPU is below the best's, so it could only
add points below the best's rate. The results say how many such there are.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from testbed.search.search import FINAL, FLOOR, PRUNED, Search
from testbed.search.space import KNOBS, Deployment

RESULTS = {
    "configs": "search_configs.csv",
    "knobs": "search_knobs.csv",
    "runs": "search_runs.csv",
    "front": "search_front.csv",
    "best": "search_best.csv",
    "json": "search.json",
}


@dataclass
class SearchRecord:
    """What the results say beside the search's own state."""

    settings: dict[str, Any]
    deployments: list[Deployment]  # the whole space
    dropped: dict[int, tuple[str, str]]  # by Deployment.num: (rule, reason)
    starts: dict[int, float]  # the first rate tried (req/s), by num
    latency_sources: dict[int, str]
    floors: str  # "on", or why the latency floors were off
    trace: str
    num_requests: int
    model: str
    hardware: str
    setup_s: float = 0.0
    wall_s: float = 0.0
    interrupted: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def _r(x: float | None) -> float | None:
    """A number for the tables (NaN as empty)."""
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x


def config_rows(search: Search, record: SearchRecord) -> list[dict[str, Any]]:
    """One row per (configuration, SLO) searched, and one per configuration the
    checks dropped (its SLO empty)."""
    sims: dict[int, int] = {}
    for run in search.runs:
        sims[run.dep] = sims.get(run.dep, 0) + 1
    rows = []
    for dep in record.deployments:
        base = {"config": dep.id, "shape": dep.shape, "gpus": dep.gpus, **dep.knobs()}
        if dep.num in record.dropped:
            rule, why = record.dropped[dep.num]
            rows.append(base | {"slo": "", "status": f"dropped: {rule}", "reason": why})
            continue
        for slo in search.slos:
            iv = search.intervals[(dep.num, slo.name)]
            ttft = tpot = None
            if iv.lo_run is not None:
                ttft, tpot = slo.latencies(search.runs[iv.lo_run].metrics)
            rows.append(
                base
                | {
                    "slo": slo.name,
                    "status": iv.status,
                    "reason": iv.reason,
                    "rate_req_s": _r(iv.lo),
                    "rate_req_s_per_gpu": _r(search.per_gpu(dep.num, iv.lo)),
                    "missed_at_req_s_per_gpu": _r(search.per_gpu(dep.num, iv.hi)),
                    "ttft_s_at_rate": _r(ttft),
                    "tpot_s_at_rate": _r(tpot),
                    "simulations": sims.get(dep.num, 0),
                    "rounds": iv.rounds,
                    "start_req_s_per_gpu": _r(record.starts[dep.num] / dep.gpus),
                    "notes": "; ".join(iv.notes),
                }
            )
    return rows


def shown(run_dir: str | None, out: Path) -> str | None:
    """A run's folder relative to the results' folder where it lies inside (the
    results then move with it), else as it is."""
    if run_dir is None:
        return None
    try:
        return Path(run_dir).resolve().relative_to(out.resolve()).as_posix()
    except ValueError:
        return run_dir


def run_rows(search: Search, out: Path) -> list[dict[str, Any]]:
    """One row per simulation: its configuration, rate, latencies and verdicts (its
    folder relative to ``out``)."""
    rows = []
    for run in search.runs:
        dep = search.deps[run.dep]
        row = {"run": run.index, "round": run.round, "config": dep.id, "shape": dep.shape,
               "gpus": dep.gpus, "rate_req_s": _r(run.rate),
               "rate_req_s_per_gpu": _r(run.rate / dep.gpus)}  # fmt: skip
        m = run.metrics or {}
        for slo in search.slos:
            ttft, tpot = slo.latencies(m)
            row |= {
                f"met_{slo.name}": run.met.get(slo.name),
                f"ttft_s_{slo.percentile}": _r(ttft),
                f"tpot_s_{slo.percentile}": _r(tpot),
            }
        row |= {
            "num_finished": m.get("num_finished"),
            "num_requests": m.get("num_requests"),
            "latency_model_source": m.get("latency_model_source"),
            "error": run.error,
            "run_dir": shown(run.run_dir, out),
        }
        rows.append(row)
    return rows


def pareto(points: list[dict[str, Any]], latency: str) -> list[dict[str, Any]]:
    """The points no other beats: higher rate per GPU at no more ``latency``, or
    lower ``latency`` at no less rate (best rate first)."""
    ordered = sorted(points, key=lambda p: (-p["rate_req_s_per_gpu"], p[latency]))
    front, lowest = [], math.inf
    for p in ordered:
        if p[latency] < lowest:
            front.append(p)
            lowest = p[latency]
    return front


def front_rows(search: Search) -> list[dict[str, Any]]:
    """Per SLO and latency (TTFT, TPOT at the SLO's percentile), the Pareto front of
    the simulations that met the SLO."""
    rows = []
    for slo in search.slos:
        points = []
        for run in search.runs:
            if not run.met.get(slo.name):
                continue
            ttft, tpot = slo.latencies(run.metrics)
            dep = search.deps[run.dep]
            status = search.intervals[(dep.num, slo.name)].status
            points.append({"slo": slo.name, "config": dep.id, "label": dep.label,
                           "rate_req_s_per_gpu": run.rate / dep.gpus, "ttft_s": ttft,
                           "tpot_s": tpot, "run": run.index, "config_status": status})  # fmt: skip
        for latency in ("ttft_s", "tpot_s"):
            for p in pareto(points, latency):
                rows.append({"latency": latency, **p})
    return rows


def best_rows(search: Search, record: SearchRecord) -> list[dict[str, Any]]:
    """Per SLO: the configuration with the highest rate per GPU proven, and the
    others within the tolerance of it (a tie at the search's precision)."""
    rows = []
    for slo in search.slos:
        best = search.best(slo.name)
        if best is None:
            rows.append({"slo": slo.name, "slo_label": slo.label, "config": None,
                         "note": "no configuration met it at any rate tried"})  # fmt: skip
            continue
        rate, holder = best
        dep = search.deps[holder]
        iv = search.intervals[(holder, slo.name)]
        ttft, tpot = slo.latencies(search.runs[iv.lo_run].metrics)
        ties = [
            search.deps[n].id
            for (n, s), other in search.intervals.items()
            if s == slo.name and n != holder and other.lo is not None
            and other.lo / search.deps[n].gpus >= rate / (1 + search.rel_tol)
        ]  # fmt: skip
        rows.append(
            {
                "slo": slo.name,
                "slo_label": slo.label,
                "config": dep.id,
                "label": dep.label,
                "gpus": dep.gpus,
                **dep.knobs(),
                "rate_req_s": _r(iv.lo),
                "rate_req_s_per_gpu": _r(rate),
                "missed_at_req_s_per_gpu": _r(search.per_gpu(holder, iv.hi)),
                f"ttft_s_{slo.percentile}": _r(ttft),
                f"tpot_s_{slo.percentile}": _r(tpot),
                "status": iv.status,
                "within_tolerance": ", ".join(ties),
                "latency_model_source": record.latency_sources.get(holder),
            }
        )
    return rows


def knob_effects(search: Search, record: SearchRecord) -> list[dict[str, Any]]:
    """Per SLO, knob and value other than the best configuration's: the rate per
    GPU the configurations with that value reach, as fractions of the best's: at
    least (the highest any of them met) and at most (the lowest it could miss:
    its miss where it was pruned, 0 where its latency floor misses). The value
    mattered where even the most is below the best by more than the tolerance,
    did not where the least is within it; otherwise the search, having pruned
    it at the best's own rate, did not settle how far below it lies."""
    rows = []
    for slo in search.slos:
        best = search.best(slo.name)
        if best is None:
            continue
        rate, holder = best
        winner = search.deps[holder].knobs()
        tie = 1 / (1 + search.rel_tol)
        for knob in KNOBS:
            for value in getattr(record.settings["space"], knob):
                if value == winner[knob]:
                    continue
                nums = [n for n, d in search.deps.items() if getattr(d, knob) == value]
                row = {"slo": slo.name, "knob": knob, "best_value": winner[knob],
                       "value": value, "configurations": len(nums)}  # fmt: skip
                if not nums:
                    rows.append(row | {"verdict": "none passes the checks"})
                    continue
                most, least, top = 0.0, 0.0, None
                for n in nums:
                    iv = search.intervals[(n, slo.name)]
                    if iv.status == FLOOR:
                        upper = 0.0
                    elif iv.hi is not None:
                        upper = iv.hi / search.deps[n].gpus
                    else:
                        upper = math.inf
                    lower = iv.lo / search.deps[n].gpus if iv.lo is not None else 0.0
                    if upper > most:
                        most, top = upper, search.deps[n].id
                    least = max(least, lower)
                at_most, at_least = most / rate, least / rate
                verdict = (
                    "mattered" if at_most < tie else "did not" if at_least >= tie else ("unsettled")
                )
                rows.append(row | {"reach_at_least": at_least, "reach_at_most": _r(at_most),
                                   "highest": top, "verdict": verdict})  # fmt: skip
    return rows


def coverage(search: Search) -> dict[str, str]:
    """Per SLO, what the drawn front covers: configurations with a point, and those
    pruned (or stopped) before any rate met the SLO, with the rate they are below."""
    out = {}
    for slo in search.slos:
        ivs = {n: search.intervals[(n, slo.name)] for n in search.deps}
        with_point = [n for n, iv in ivs.items() if iv.lo is not None]
        text = f"{len(with_point)} of {len(search.deps)} configurations have a point"
        without: dict[str, list[int]] = {}
        for n, iv in ivs.items():
            if iv.lo is None:
                without.setdefault(iv.status, []).append(n)
        for status, nums in sorted(without.items()):
            text += f"; {len(nums)} {status} before any rate tried met it"
            if status == PRUNED:
                his = [search.per_gpu(n, ivs[n].hi) for n in nums]
                text += f" (each missing it at or below {max(his):.4g} req/s per GPU)"
            elif status == FLOOR:
                text += " (their latency floor is above a target: they meet it at no rate)"
        out[slo.name] = text
    return out


def counts(search: Search, record: SearchRecord) -> dict[str, Any]:
    """The search's cost: the space, what the checks dropped by rule, the pairs by
    how they stopped, the simulations and rounds, the wall time."""
    by_rule: dict[str, int] = {}
    for rule, _ in record.dropped.values():
        by_rule[rule] = by_rule.get(rule, 0) + 1
    by_status = {s: 0 for s in (*FINAL, "live", "waiting")}
    for iv in search.intervals.values():
        by_status[iv.status] += 1
    simulated = {run.dep for run in search.runs}
    return {
        "space": len(record.deployments),
        "checked_out": by_rule,
        "searched": len(search.deps),
        "slos": len(search.slos),
        "pairs": {k: v for k, v in by_status.items() if v},
        "configurations_simulated": len(simulated),
        "simulations": len(search.runs),
        "failed_simulations": sum(run.metrics is None for run in search.runs),
        "rounds": search.round,
        "bound": search.bound,
        "setup_s": round(record.setup_s, 3),
        "wall_s": round(record.wall_s, 3),
        "interrupted": record.interrupted,
    }


def summary_text(best: list[dict[str, Any]], n: dict[str, Any], cover: dict[str, str]) -> str:
    """The printed table: the best configuration per SLO, then the cost."""
    lines = ["best configuration per SLO (highest SLO-meeting rate per GPU):"]
    table = pd.DataFrame(
        [
            {
                "SLO": b["slo_label"],
                "config": b.get("config") or "-",
                "deployment": b.get("label") or b.get("note", ""),
                "req/s/GPU": b.get("rate_req_s_per_gpu"),
                "GPUs": b.get("gpus"),
                "ties": b.get("within_tolerance") or "",
            }
            for b in best
        ]
    )
    lines.append(table.to_string(index=False))
    checked = ", ".join(f"{v} {k}" for k, v in n["checked_out"].items()) or "none"
    pairs = ", ".join(f"{v} {k}" for k, v in n["pairs"].items())
    lines += [
        f"space {n['space']} configurations; dropped before simulating: {checked}; "
        f"searched {n['searched']} x {n['slos']} SLOs ({pairs})",
        f"{n['simulations']} simulations of {n['configurations_simulated']} configurations in "
        f"{n['rounds']} rounds, {n['wall_s']:.1f} s",
    ]
    lines += [f"front under {slo}: {text}" for slo, text in cover.items()]
    if n["interrupted"]:
        lines.append("INTERRUPTED: the search stopped part-way; the above is what it had found")
    return "\n".join(lines)


def write_results(out: Path, search: Search, record: SearchRecord) -> dict[str, Any]:
    """Write the results' files and the page to ``out``, print the summary; returns
    what ``search.json`` holds."""
    from testbed.search.page import write_page

    out.mkdir(parents=True, exist_ok=True)
    configs, runs = config_rows(search, record), run_rows(search, out)
    front, best = front_rows(search), best_rows(search, record)
    cover, n, knobs = coverage(search), counts(search, record), knob_effects(search, record)
    tables = {"configs": configs, "runs": runs, "front": front, "best": best, "knobs": knobs}
    for key, rows in tables.items():
        pd.DataFrame(rows).to_csv(out / RESULTS[key], index=False)
    settings = record.settings
    result = {
        "trace": record.trace,
        "num_requests": record.num_requests,
        "requests_per_instance": settings.get("requests_per_instance"),
        "model": record.model,
        "hardware": record.hardware,
        "budget": settings["budget"],
        "slos": [vars(s) for s in search.slos],
        "space": {k: list(getattr(settings["space"], k)) for k in KNOBS},
        "rel_tol": search.rel_tol,
        "probes": settings["probes"],
        "latency_floors": record.floors,
        "counts": n,
        "best": best,
        "knob_effects": knobs,
        "front_covers": cover,
        "front": front,
        **record.extra,
    }
    (out / RESULTS["json"]).write_text(json.dumps(result, indent=1, default=str) + "\n")
    text = summary_text(best, n, cover)
    print(f"\n{text}\nresults in {out} ({', '.join(RESULTS.values())})")
    try:
        page = write_page(out, result, configs, runs, search)
        print(f"search page (opens offline): {page}")
    except Exception as e:  # the results are written; a figure that fails must not hide them
        print(f"WARNING: the search page could not be written: {type(e).__name__}: {e}")
    return result
