"""The simulator against the real engine: a simulated and a real run of one
setting paired, and the simulation's error against the real run.

One definition serves every place that asks (the sweep's summary, the fidelity
experiment and the scripts over its results):

* a pair: each simulation with the one real run of its setting
  (:func:`pair_runs`); a setting is a job's overrides but those of ``mode``
  (:func:`pair_key`);
* an error: ``sim / real - 1`` (:func:`relative_error`), signed, so +5% is a
  simulation 5% above the real run; NaN where either side was not measured or
  the real one is zero, which leaves nothing to be relative to;
* a target: ``|error| <= TARGETS[metric]``, the bound included; an error not
  measured is never within it (:func:`within_target`, :func:`target_misses`);
* a request-by-request join: the two runs' requests by id, which must have
  arrived at the same times (:func:`join_requests`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any, TypeVar

import numpy as np
import pandas as pd

# What a simulation is held to against its real run (the largest relative error)
TARGETS = {"throughput_req_s": 0.05, "tpot_s_mean": 0.05, "e2e_s_mean": 0.05, "ttft_s_p50": 0.10}

# What identifies a run where its overrides were not kept (see :func:`pair_key`)
IDENTITY = ("policy", "trace", "model", "hardware", "seed", "load", "num_requests")

Run = TypeVar("Run")


def pair_key(overrides: list[str] | None, metrics: Mapping[str, Any]) -> tuple[str, ...]:
    """What a simulation and its real run share: the overrides but those of
    ``mode`` and its fields (``mode.latency_scale`` and the like set how a
    simulation runs, not what it simulates), or, without overrides, the run's
    :data:`IDENTITY` from its metrics."""
    if overrides is None:
        return tuple(f"{k}={metrics.get(k)}" for k in IDENTITY)
    kept = []
    for override in overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        if key != "mode" and not key.startswith("mode."):
            kept.append(override.lstrip("+"))
    return tuple(sorted(kept))


def pair_runs(
    runs: Iterable[Run],
    setting: Callable[[Run], Hashable],
    mode: Callable[[Run], str],
    model: str = "sim",
    reference: str = "real",
) -> list[tuple[Run, Run]]:
    """Each run of mode ``model`` (a simulation) with the run of mode ``reference``
    (a real one) of its ``setting``, where exactly one such run has it (two leave no
    one run to hold it to): settings in the order they first appear, ``model`` runs
    in the order given."""
    by_setting: dict[Hashable, tuple[list[Run], list[Run]]] = {}
    for run in runs:
        judged, refs = by_setting.setdefault(setting(run), ([], []))
        if mode(run) == model:
            judged.append(run)
        elif mode(run) == reference:
            refs.append(run)
    paired = (group for group in by_setting.values() if len(group[1]) == 1)
    return [(run, refs[0]) for judged, refs in paired for run in judged]


def relative_error(sim: float | None, real: float | None) -> float:
    """``sim / real - 1``; NaN where either is None or NaN, or ``real`` is zero."""
    if sim is None or real is None or real == 0:
        return math.nan
    return float(sim / real - 1)


def metric_errors(
    sim: Mapping[str, Any], real: Mapping[str, Any], keys: Iterable[str]
) -> dict[str, float]:
    """The :func:`relative_error` of each of ``keys`` between two runs' metrics
    (NaN where either lacks it)."""
    return {key: relative_error(sim.get(key), real.get(key)) for key in keys}


def within_target(metric: str, error):
    """Whether ``error`` (a number, or an array of them) is within ``metric``'s
    :data:`TARGETS`; None and NaN are not."""
    bound = TARGETS[metric]
    if error is None:
        return False
    if np.ndim(error) == 0:
        return bool(abs(float(error)) <= bound)
    return np.abs(np.asarray(error, float)) <= bound


def target_misses(errors: Mapping[str, float | None]) -> dict[str, float | None]:
    """Every :data:`TARGETS` metric whose error in ``errors`` is not within its
    target, with that error (None or NaN: not measured); empty where all are met."""
    return {m: errors.get(m) for m in TARGETS if not within_target(m, errors.get(m))}


def join_requests(sim: pd.DataFrame, real: pd.DataFrame, column: str, what: str) -> pd.DataFrame:
    """Two runs' ``requests.csv`` frames joined by ``request_id``: ``<column>_sim``
    and ``<column>_real`` of each request both have it for. A ValueError naming
    ``what`` where the runs did not replay the same requests at the same
    arrival times, whose requests would be no pairs."""
    rs, rr = sim.set_index("request_id"), real.set_index("request_id")
    arrivals = rs[["arrival_s"]].join(rr[["arrival_s"]].add_suffix("_real"), how="outer")
    if not np.allclose(arrivals["arrival_s"], arrivals["arrival_s_real"], atol=1e-6):
        raise ValueError(f"{what} did not replay the same arrivals")
    return rs[[column]].join(rr[[column]], suffixes=("_sim", "_real")).dropna()
