"""The highest arrival rate an engine sustains on a trace, found in simulation.

``python run.py trace=azure_conv load=0.7`` replays the trace at 70% of it:
policy studies compare policies at a load (light, near saturation, overload)
rather than at a rate that means something else on every machine, model and
engine config. A rate is *sustained* when the run is not ``overloaded``
(``testbed.metrics.summary.fell_behind``, the run's own verdict), judged from
the arrival of the first quarter's last request (the engine has filled up by
then) to the last arrival: overloaded when fewer than 95% as many admitted
requests finish as arrive (not counting the last, which cannot have finished)
*and* the number in flight grew by more than three times its spread about its
trend. Below capacity finishes and arrivals differ only by the change in the
number in flight; above it, finishes fall behind by the excess rate times the
window, and the backlog grows all the while. The count alone mistakes a burst
of arrivals just before the last, still in service then, for a backlog, even
on an idle engine. Counting to the last arrival leaves the drain out:
a criterion on the whole run (throughput over the offered rate) charges every
trace its last requests' latency, which on a short trace or a large cluster
caps the "capacity" well below what the engine sustains (4 replicas: 1.8 times
one on 200 requests). So ``load=1`` is the highest rate a run is not flagged
overloaded at.

The search simulates the trace, rescaled to each rate tried, under FCFS (so that
every policy of a sweep gets the same rate) on the run's engine, cluster,
model, hardware and latency model (with ``mode.latency_scale``; not a speed
trace, whose times belong to the run's clock), up to its last arrival. It
brackets the capacity by doubling or halving from the trace's own rate, then
bisects 8 times (to about 0.4%). Bursts overstate capacity (they run in batches
a steady stream never forms), which is why this is a search over rates and not
one run at full speed.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pandas as pd
from omegaconf import DictConfig, OmegaConf

from testbed.build import latency_model, load_requests, max_concurrency, model_spec, run_trace
from testbed.config_schema import SimMode
from testbed.errors import InputError
from testbed.metrics.records import requests_frame
from testbed.metrics.summary import (
    SUSTAINED,
    WARM_UP,
    arrivals_window,
    fell_behind,
    finished_and_arrived,
)
from testbed.models import ModelSpec
from testbed.modes.sim import simulate
from traces.transforms import mean_rate

BISECTIONS = 8
LOWEST_RATE = 1e-3  # req/s: below this the search gives up
HIGHEST_RATE = 1e6
# Fewer arrivals in the window than about 15 leave no room for one in flight
# beside the last (the tolerance is 5% of them plus the last itself).
MIN_REQUESTS = 20
SEARCH_VERSION = 4  # bump when the search or the simulator changes what it finds
TRACE_COLUMNS = ["arrival_s", "prompt_tokens", "output_tokens", "prefix_hash_ids"]


def search_config(cfg: DictConfig) -> DictConfig:
    """``cfg`` as the search simulates it: FCFS, in simulation, quiet."""
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    mode = cfg.mode
    out.policy = {"name": "fcfs", "victim": None}
    out.mode = asdict(SimMode(latency_scale=mode.latency_scale if mode.name == "sim" else 1.0))
    out.progress = False
    return out


def sustains(cfg: DictConfig, spec: ModelSpec, rate: float) -> bool:
    """Whether the engine of ``cfg`` keeps up with its trace rescaled to ``rate``
    req/s (see the module docstring), in the search's simulation of it."""
    cfg = search_config(cfg)
    trace, requests = load_requests(cfg, spec, rate=rate)
    start, last = arrivals_window(trace["arrival_s"].to_numpy(float))
    # Past the last arrival (which is then admitted or rejected); later finishes do not count.
    cfg.mode.max_sim_time_s = last + 1e-6
    result, _ = simulate(cfg, requests, spec)
    if result.error is not None:  # an interrupt too: the search stops for it
        raise result.error
    df = requests_frame(result.requests)
    admitted = df[df["status"] != "rejected"]
    if admitted.empty:
        raise ValueError(
            f"trace {cfg.trace.name!r}: the engine rejects every request (see the reasons in "
            "requests.csv of a plain run), so it has no capacity to scale to"
        )
    if not finished_and_arrived(admitted, start, last)[1]:
        raise ValueError(
            f"trace {cfg.trace.name!r}: no admitted request arrives after its first quarter, "
            "so no rate can be judged sustained"
        )
    return not fell_behind(admitted, start, last)


def bracket(cfg: DictConfig, spec: ModelSpec, start_rate: float) -> tuple[float, float]:
    """Rates ``(lo, hi)`` about 0.4% apart, the trace sustained at ``lo`` and not
    at ``hi``. On a short trace whether a rate is sustained is a matter of where
    its arrivals happen to bunch, so a rate between them, or above ``hi``, may
    go either way: the capacity of a few hundred requests is approximate."""
    rate = start_rate
    if sustains(cfg, spec, rate):
        lo, hi = rate, 2 * rate
        while sustains(cfg, spec, hi):
            if hi > HIGHEST_RATE:
                raise ValueError(f"trace {cfg.trace.name!r}: sustained beyond {HIGHEST_RATE} req/s")
            lo, hi = hi, 2 * hi
    else:
        lo, hi = rate / 2, rate
        while not sustains(cfg, spec, lo):
            if lo < LOWEST_RATE:
                raise ValueError(
                    f"trace {cfg.trace.name!r}: not sustained even at {LOWEST_RATE} req/s "
                    "(does any request finish? see requests.csv of a plain run)"
                )
            lo, hi = lo / 2, lo
    for _ in range(BISECTIONS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sustains(cfg, spec, mid) else (lo, mid)
    return lo, hi


def find_capacity(
    cfg: DictConfig, spec: ModelSpec | None = None, start_rate: float | None = None
) -> float:
    """The highest sustained rate (req/s) of ``cfg``'s trace found (:func:`bracket`),
    searched from ``start_rate`` (default: the trace's own rate)."""
    spec = spec or model_spec(cfg.model)
    if start_rate is None:
        start_rate = mean_rate(run_trace(cfg))
    return bracket(cfg, spec, start_rate)[0]


def cache_key(cfg: DictConfig, trace: pd.DataFrame, latency_source: str) -> str:
    """What the capacity depends on: the search's config, the trace as loaded
    (its data, wherever it was read from, and every option applied to it), and
    the latency model (a profile's source names its checksum). Not the code:
    ``SEARCH_VERSION`` stands for it."""
    search = OmegaConf.to_container(search_config(cfg), resolve=True)
    relevant = {k: search[k] for k in ("trace", "model", "hardware", "engine", "cluster", "mode")}
    relevant.update(seed=search["seed"], latency=latency_source, search=SEARCH_VERSION)
    digest = hashlib.sha1(json.dumps(relevant, sort_keys=True, default=str).encode())
    digest.update(trace[TRACE_COLUMNS].astype(str).to_csv(index=False).encode())
    return digest.hexdigest()[:16]


def scaled_to_load(cfg: DictConfig, spec: ModelSpec) -> dict[str, Any]:
    """``metrics.json``'s record of ``load``: the capacity and the rate. With
    ``capacity_cache`` set (a folder), a capacity found for the same config and
    trace (every policy of a sweep, every load) is read from there instead of
    searched again; the record says which (``capacity_from``)."""
    load = float(cfg.load)
    if not load > 0:
        raise InputError(f"load={cfg.load}: must be a fraction of the capacity, above 0")
    if (clients := max_concurrency(cfg)) is not None:
        raise InputError(
            f"load={cfg.load} with trace={cfg.trace.name} (trace.max_concurrency={clients}): "
            "load sets an arrival rate, and a closed loop has none (each client sends when its "
            "last request ends); vary trace.max_concurrency instead, or drop load"
        )
    if cfg.trace.get("time_scale") is not None:
        raise InputError("load sets the trace's rate; trace.time_scale would rescale it after")
    trace = run_trace(cfg)  # as configured: the search starts from its rate
    if len(trace) < MIN_REQUESTS:
        raise InputError(
            f"load={cfg.load}: trace {cfg.trace.name!r} has {len(trace)} requests; judging a "
            f"rate sustained takes at least {MIN_REQUESTS} (on 8 the search finds 0.02 req/s)"
        )
    try:
        start_rate = mean_rate(trace)
    except ValueError as e:
        raise InputError(f"load={cfg.load}: {e}") from e
    found: dict[str, Any] = {}
    path = None
    if cfg.get("capacity_cache"):
        key = cache_key(cfg, trace, latency_model(cfg, spec).source)
        path = Path(cfg.capacity_cache) / f"{cfg.trace.name}-{key}.json"
        if path.exists():
            found = json.loads(path.read_text())
    if "capacity_req_s" in found:
        capacity, origin = float(found["capacity_req_s"]), f"cached {path}"
    else:
        capacity, origin = find_capacity(cfg, spec, start_rate), "searched"
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")  # parallel runs write alike
            tmp.write_text(json.dumps({"capacity_req_s": capacity, "trace": cfg.trace.name}))
            os.replace(tmp, path)
    return {
        "load": load,
        "capacity_req_s": capacity,
        "capacity_from": origin,
        "rate_req_s": load * capacity,
    }


__all__ = [
    "SUSTAINED",
    "WARM_UP",
    "bracket",
    "find_capacity",
    "scaled_to_load",
    "search_config",
    "sustains",
]
