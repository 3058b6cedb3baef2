"""Metrics of a run, from its per-request records and its step log.

Definitions (times in seconds, rates per second):

* TTFT: first token time - arrival. TPOT: (finish - first token) / (output tokens - 1),
  per request with at least two output tokens. ITL: every gap between two
  consecutive tokens of a request, pooled over requests (tokens accepted
  together in one speculative step have a gap of 0). E2E: finish - arrival.
  Queue: first scheduled - arrival.
* Latency statistics cover finished requests (not rejected, not unfinished).
* duration_s: from the first arrival to the last finish; in a run stopped
  part-way, to the moment it stopped (its rates are over the time it ran, not
  over the span of the few requests that finished). Throughputs count finished
  requests and their tokens over that duration.
* SLOs: a finished request meets its SLOs when its TTFT and TPOT are within
  those it carries (one it lacks is met). ``slo_attainment`` is the fraction of
  all requests that finished and met them (rejected and unfinished ones miss);
  ``goodput_req_s`` counts those per second.
* offered_req_s: the requests not rejected, over the span of their arrivals.
  waiting_at_last_arrival: how many of them had not been scheduled yet when the
  last one arrived (in a run stopped part-way, of those that arrived by its
  last step). finished_per_arrival: from the arrival of the first quarter's
  last request to the last arrival, the requests that finished over those that
  arrived.
  backlog_growth: how much the number of admitted requests in the engine
  (arrived, not finished) grew over that window, by a least-squares line
  through its value at each arrival; backlog_spread: the standard deviation of
  those values about the line.
* overloaded: the engine fell behind the trace, so latencies measure a backlog
  that grows with the trace's length rather than the policy's effect on a
  steady queue. True when fewer than 95% as many requests finished as arrived
  in the window (but for the last, which cannot have) and the backlog grew by
  more than three times its spread about its trend (a queue that fluctuates finishes
  fewer than arrived over a short window too; one that grows does so for the
  whole window). None (not judged) in a run stopped part-way or with fewer
  than :data:`MIN_ARRIVALS` arrivals in the window: too few to tell a growing
  queue from a fluctuating one. The capacity search (``testbed/capacity.py``)
  finds the highest rate at which a run is not overloaded.
* top_reject_reasons: the commonest reasons of the rejected requests, alike but
  for their numbers, with their counts; a number that varies among them as its
  range (``12 x prompt of 4100-9000 tokens exceeds max_model_len=4096``).
* kv_usage_mean weights each step by its latency (a time average).
* tenant_service_jain: Jain's index over tenants of (tokens served / tokens
  asked for); 1.0 when every tenant got the same share of what it asked.
* tenant_ttft_jain: Jain's index over tenants of 1 / (the tenant's mean TTFT):
  1.0 when every tenant waits as long for its first token, 1/n when one tenant
  alone is served promptly. (Where every request is served in the end, as in a
  replayed trace that drains, ``tenant_service_jain`` is 1.0 whatever the order;
  this one sees the order.)
* per_tenant: for each tenant, its requests, finished requests, TTFT, TPOT and
  E2E means and p99s, tokens asked for and served (prompt + output), its
  service share (served / asked) and SLO attainment.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import pandas as pd

from testbed.core.request import SERVED
from testbed.metrics.records import requests_frame
from testbed.metrics.result import RunResult
from testbed.metrics.steplog import StepLog

LATENCIES = ("ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s")


STATISTICS = ("mean", "p50", "p90", "p99")  # what metrics.json gives of each latency


def statistics(values: np.ndarray, names: tuple[str, ...] = STATISTICS) -> dict[str, float]:
    """The named statistics of ``values`` (``mean`` or a percentile ``pNN``), NaN
    ignored; NaN where no value is left."""
    values = values[~np.isnan(values)]
    if values.size == 0:
        return dict.fromkeys(names, math.nan)
    pct = [s for s in names if s != "mean"]
    out = dict(zip(pct, np.percentile(values, [float(s[1:]) for s in pct]).tolist()))
    return {s: float(values.mean()) if s == "mean" else out[s] for s in names}


def _stats(name: str, values: np.ndarray) -> dict[str, float]:
    return {f"{name}_{s}": v for s, v in statistics(values).items()}


SUSTAINED = 0.95  # requests finished over requests arrived, in the window
WARM_UP = 0.25  # the window starts at this fraction of the arrivals
FINISHED = tuple(s.name.lower() for s in SERVED)  # requests.csv's names of the served


def arrivals_window(arrivals: np.ndarray) -> tuple[float, float]:
    """From the arrival of the first quarter's last request (the engine has filled
    up by then) to the last arrival."""
    arrivals = np.sort(np.asarray(arrivals, dtype=float))
    return float(arrivals[int(WARM_UP * len(arrivals))]), float(arrivals[-1])


def finished_and_arrived(admitted: pd.DataFrame, start: float, last: float) -> tuple[int, int]:
    """How many of the admitted requests finished, and how many arrived, from
    ``start`` to ``last``."""
    arrived = int(admitted["arrival_s"].between(start, last).sum())
    done = admitted["status"].isin(FINISHED) & admitted["finish_s"].between(start, last)
    return int(done.sum()), arrived


def kept_up(finished: int, arrived: int) -> bool:
    """Whether requests finished as fast as they arrived (:data:`SUSTAINED`); + 1:
    the last arrival itself cannot have finished by then."""
    return finished + 1 >= SUSTAINED * arrived


# Below this many arrivals in the window no overload verdict is given: a short
# trace is mostly the engine filling up (its batch, then its step time and the
# number in flight, grow until they settle), which a least-squares trend cannot
# tell from a queue that grows without end (measured: docs/outputs.md).
MIN_ARRIVALS = 50
GROWTH_SPREADS = 3.0  # a backlog grows when its trend rises this many spreads


def backlog_trend(admitted: pd.DataFrame, start: float, last: float) -> tuple[float, float]:
    """The growth over ``[start, last]`` of the number of admitted requests that
    had arrived and not finished, by a least-squares line through its value at
    each arrival there, and its standard deviation about that line."""
    arrivals = np.sort(admitted["arrival_s"].to_numpy(float))
    finishes = np.sort(admitted["finish_s"].dropna().to_numpy(float))
    at = arrivals[(arrivals >= start) & (arrivals <= last)]
    if len(at) < 3 or last <= start:
        return math.nan, math.nan
    in_engine = np.searchsorted(arrivals, at, "right") - np.searchsorted(finishes, at, "right")
    slope, intercept = np.polyfit(at, in_engine, 1)
    spread = float(np.std(in_engine - (slope * at + intercept)))
    return float(slope * (last - start)), spread


def fell_behind(admitted: pd.DataFrame, start: float, last: float) -> bool:
    """The overload verdict over ``[start, last]``: fewer finished than arrived
    (not :func:`kept_up`) *and* a backlog that grew by more than
    :data:`GROWTH_SPREADS` spreads. The count alone also fails a queue that
    fluctuates: a burst of arrivals near the last one, still in service then,
    fails it on an idle engine. The trend alone also rises with a trace whose
    rate rises."""
    finished, arrived = finished_and_arrived(admitted, start, last)
    growth, spread = backlog_trend(admitted, start, last)
    return not kept_up(finished, arrived) and growth > GROWTH_SPREADS * spread


def backlog(
    df: pd.DataFrame, end: float = math.inf, partial: bool = False
) -> dict[str, float | int | bool | None]:
    """Whether the engine kept up with the trace (see the module docstring), over
    the requests that arrived by ``end`` (where a run stopped part-way)."""
    admitted = df[(df["status"] != "rejected") & (df["arrival_s"] <= end)]
    if admitted.empty:
        return {
            "offered_req_s": math.nan,
            "waiting_at_last_arrival": 0,
            "finished_per_arrival": math.nan,
            "backlog_growth": math.nan,
            "backlog_spread": math.nan,
            "overloaded": None,
        }
    arrivals = admitted["arrival_s"]
    last = float(arrivals.max())
    span = last - float(arrivals.min())
    # Never scheduled (an interrupted run's waiting requests) counts as not yet.
    started = admitted["first_scheduled_s"].fillna(math.inf)
    waiting = int((started > last).sum())
    window = arrivals_window(arrivals.to_numpy())
    finished, arrived = finished_and_arrived(admitted, *window)
    growth, spread = backlog_trend(admitted, *window)
    grew = fell_behind(admitted, *window)
    return {
        "offered_req_s": len(admitted) / span if span > 0 else math.nan,
        "waiting_at_last_arrival": waiting,
        "finished_per_arrival": finished / arrived if arrived else math.nan,
        "backlog_growth": growth,
        "backlog_spread": spread,
        "overloaded": None if partial or arrived < MIN_ARRIVALS else bool(grew),
    }


NUMBER = r"\d+(?:\.\d+)?"


def top_reject_reasons(df: pd.DataFrame, most: int = 3) -> str:
    """The commonest rejection reasons, alike but for their numbers, with their
    counts; a number the same in every one as it is, one that varies as its range:
    ``"12 x prompt of 4100-9000 tokens exceeds max_model_len=4096; 3 x ..."``
    ("" where nothing was rejected)."""
    reasons = df.loc[df["status"] == "rejected", "reason"].dropna().astype(str)
    if reasons.empty:
        return ""
    kinds = reasons.str.replace(NUMBER, "\0", regex=True)  # a mark no reason holds
    parts = []
    for kind, n in kinds.value_counts().head(most).items():
        numbers = reasons[kinds == kind].str.findall(NUMBER)
        columns = zip(*numbers, strict=True)
        shown = iter([span(list(values)) for values in columns])
        parts.append(f"{n} x " + re.sub("\0", lambda _, shown=shown: next(shown), kind))
    return "; ".join(parts)


def span(values: list[str]) -> str:
    """One number where all are the same, else their lowest-highest."""
    low, high = min(values, key=float), max(values, key=float)
    return low if float(low) == float(high) else f"{low}-{high}"


def _jain(x: np.ndarray) -> float:
    return float(x.sum() ** 2 / (len(x) * (x**2).sum())) if len(x) and (x**2).sum() > 0 else 1.0


def per_tenant(df: pd.DataFrame, done: pd.DataFrame, met: pd.Series) -> dict[str, dict]:
    """Each tenant's counts, latencies, tokens and SLO attainment (the module
    docstring), by tenant name."""
    out = {}
    done_by = dict(tuple(done.groupby("tenant", sort=False)))
    met_by = met.groupby(done["tenant"], sort=False).sum()
    for tenant, rows in df.groupby("tenant", sort=True):
        fin = done_by.get(tenant, done.iloc[:0])
        asked = float(rows["prompt_tokens"].sum() + rows["output_tokens"].sum())
        served = float(fin["prompt_tokens"].sum() + fin["output_tokens"].sum())
        stats = {"num_requests": len(rows), "num_finished": len(fin)}
        for name in ("ttft_s", "tpot_s", "e2e_s"):
            values = _stats(name, fin[name].to_numpy(float))
            stats |= {k: values[k] for k in (f"{name}_mean", f"{name}_p99")}
        stats |= {
            "asked_tokens": asked,
            "served_tokens": served,
            "service_share": served / asked if asked > 0 else math.nan,
            "slo_attainment": float(met_by.get(tenant, 0)) / len(rows),
        }
        out[str(tenant)] = stats
    return out


def step_totals(steps: StepLog) -> dict[str, float]:
    """Over every step: when the last ended (``end``), busy time (the latencies'
    sum), KV usage x latency (``kv_time``) and the highest KV usage; a piece of
    the log at a time (sums by piece where the log is longer than one)."""
    end, busy, kv_time, kv_max = -math.inf, 0.0, 0.0, math.nan
    for piece in steps.pieces(("start_s", "latency_s", "kv_usage")):
        lat, usage = piece["latency_s"], piece["kv_usage"]
        end = max(end, float((piece["start_s"] + lat).max()))
        busy += lat.sum()
        kv_time += (usage * lat).sum()
        kv_max = float(usage.max()) if math.isnan(kv_max) else max(kv_max, float(usage.max()))
    return {"end": end, "busy": busy, "kv_time": kv_time, "kv_max": kv_max}


def summarize(result: RunResult, df: pd.DataFrame | None = None) -> dict[str, float]:
    """Every metric of ``metrics.json`` that the run's records determine (``df``:
    its ``requests_frame``, where already built)."""
    steps = result.steps
    df = requests_frame(result.requests) if df is None else df
    done = df[df["status"].isin(FINISHED)]
    n_done = len(done)
    start = float(df["arrival_s"].min()) if len(df) else 0.0
    end = float(done["finish_s"].max()) if n_done else start
    if result.partial:  # over the time it ran, not the span of what finished
        end = max(end, result.duration_s)
    duration = end - start
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: math.nan)
    out_tok = float(done["output_tokens"].sum())
    in_tok = float(done["prompt_tokens"].sum())
    met = (done["ttft_s"] <= done["ttft_slo_s"].fillna(np.inf)) & (
        done["tpot_s"].fillna(0) <= done["tpot_slo_s"].fillna(np.inf)
    )
    m: dict[str, float] = {
        "num_requests": len(df),
        "num_finished": n_done,
        "num_rejected": int((df["status"] == "rejected").sum()),
        "num_unfinished": int(
            len(df)
            - n_done
            - (df["status"] == "rejected").sum()
            - (df["status"] == "finished_aborted").sum()
        ),
        "duration_s": duration,
        "throughput_req_s": per_s(n_done),
        "throughput_output_tok_s": per_s(out_tok),
        "throughput_total_tok_s": per_s(in_tok + out_tok),
    }
    for name in LATENCIES:
        if name == "itl_s":
            m.update(result.itl_gaps().stats(name))
        else:
            m.update(_stats(name, done[name].to_numpy(float)))
    totals = step_totals(steps)
    m.update(backlog(df, totals["end"], result.partial))
    m["top_reject_reasons"] = top_reject_reasons(df)
    m["num_preemptions"] = int(df["preemptions"].sum())
    m["goodput_req_s"] = per_s(int(met.sum()))
    m["slo_attainment"] = float(met.sum() / len(df)) if len(df) else math.nan
    busy = totals["busy"]
    m["kv_usage_mean"] = float(totals["kv_time"] / busy) if busy > 0 else math.nan
    m["kv_usage_max"] = totals["kv_max"]
    m["num_steps"] = len(steps)
    asked = df.groupby("tenant")[["prompt_tokens", "output_tokens"]].sum().sum(axis=1)
    served = done.groupby("tenant")[["prompt_tokens", "output_tokens"]].sum().sum(axis=1)
    m["tenant_service_jain"] = _jain((served.reindex(asked.index).fillna(0) / asked).to_numpy())
    m["per_tenant"] = per_tenant(df, done, met)
    ttft = np.array([t["ttft_s_mean"] for t in m["per_tenant"].values()], dtype=float)
    ttft = ttft[~np.isnan(ttft)]
    m["tenant_ttft_jain"] = _jain(1 / ttft) if len(ttft) and (ttft > 0).all() else math.nan
    # Disaggregated prefill/decode, either mode: the transfers that moved KV (a
    # failed one moved none: its request recomputed the prompt).
    moved = df[(df["kv_transfer_bytes"] > 0) & ~df["kv_transfer_failed"]]
    failed = df[df["kv_transfer_failed"]]
    if len(moved) or len(failed):
        m["kv_transfers"] = len(moved)
        m["kv_transfer_bytes"] = float(moved["kv_transfer_bytes"].sum())
        took = moved["kv_transfer_end_s"] - moved["kv_transfer_start_s"]
        m.update(_stats("kv_transfer_s", took.to_numpy(float)))
        m["kv_transfers_failed"] = len(failed)
        m["kv_recomputed_tokens"] = int(failed["kv_recomputed_tokens"].sum())
    return m


PER_GPU = (
    "throughput_req_s",
    "throughput_output_tok_s",
    "throughput_total_tok_s",
    "goodput_req_s",
    "capacity_req_s",
)


def per_gpu(metrics: dict[str, Any]) -> dict[str, float]:
    """The run's throughputs and goodput divided by its GPUs (``num_gpus``: replicas
    x tensor x pipeline parallel), as ``<name>_per_gpu``: what deployments of
    different sizes are compared by."""
    gpus = metrics.get("num_gpus") or 1
    return {f"{name}_per_gpu": metrics[name] / gpus for name in PER_GPU if name in metrics}
