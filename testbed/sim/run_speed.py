"""A real run's speed against a latency model of its machine: its steps' measured
time over the model's prediction of the very same steps, for the whole run and
window by window (``speed_vs_profile`` in a real run's ``metrics.json``)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from testbed.sim.latency import LatencyModel


def step_column(steps, name: str) -> np.ndarray:
    """One column of a :class:`~testbed.metrics.steplog.StepLog` or of a
    ``steps.csv`` frame (the same columns), as floats."""
    values = steps.column(name) if hasattr(steps, "column") else steps[name]
    return np.asarray(values, dtype=np.float64)


def predict_logged_steps(model: LatencyModel, steps) -> np.ndarray:
    """The model's prediction of each logged step from its composition and its
    requests verifying drafts (``steps``: see :func:`step_column`; a ``steps.csv``
    from before that column: none)."""
    pred = model.predict_many(
        step_column(steps, "num_reqs"),
        step_column(steps, "num_prefill_tokens") + step_column(steps, "num_decode_tokens"),
        step_column(steps, "attn_pairs"),
        step_column(steps, "kv_tokens"),
        step_column(steps, "max_kv"),
    )
    columns = steps.columns if hasattr(steps, "columns") else ()
    if hasattr(steps, "column") or "num_spec_reqs" in columns:
        pred = pred + model.verification_s(step_column(steps, "num_spec_reqs"))
    return pred


SPEED_WINDOW_S = 60.0  # run time over which :func:`speed_against` reports the speed's range
SPEED_WINDOW_STEPS = 20  # the fewest busy steps a window needs to be counted


def speed_by_window(start_s, latency_s, pred_s, width_s: float) -> pd.DataFrame:
    """A real run's speed window by window: for each ``width_s`` seconds of its
    clock from 0 (by when a step starts), the measured time of its steps over the
    model's prediction of them (``speed``) and how many steps there were
    (``steps``), indexed by the window's number; windows without a step are left
    out. The arrays: its busy steps' start times, latencies and predictions."""
    window = (np.asarray(start_s, dtype=np.float64) // width_s).astype(np.int64)
    groups = pd.DataFrame({"real": latency_s, "pred": pred_s}, copy=False).groupby(window)
    sums = groups.sum()
    return pd.DataFrame({"speed": sums["real"] / sums["pred"], "steps": groups.size()})


def time_per_step(start_s, at_s, seconds) -> np.ndarray:
    """``seconds`` spent at times ``at_s`` (a speculative proposer's, each within
    a step), summed per step of a log whose steps start at ``start_s`` (in order):
    each to the last step started at or before it; none before the first."""
    start_s = np.asarray(start_s, dtype=np.float64)
    at_s = np.asarray(at_s, dtype=np.float64)
    step = np.searchsorted(start_s, at_s, side="right") - 1
    keep = step >= 0
    return np.bincount(
        step[keep], weights=np.asarray(seconds, dtype=np.float64)[keep], minlength=len(start_s)
    )


def speed_against(
    model: LatencyModel, steps, window_s: float = SPEED_WINDOW_S, exclude_s=None
) -> dict[str, float]:
    """How fast a real run's machine ran against ``model`` (a profile of it): the
    run's busy time over the model's prediction of the same steps (``steps``: see
    :func:`step_column`). 1.2: its steps took 20% longer than the profile says (a
    machine slower now than when profiled, or a model that under-predicts these
    steps); 1.0: as profiled. ``_min`` and ``_max``: the lowest and highest of its
    :func:`speed_by_window` over windows of ``window_s`` holding at least
    :data:`SPEED_WINDOW_STEPS` busy steps (the whole run's where fewer than two
    windows do). ``exclude_s``: per step of ``steps`` (:func:`time_per_step`), busy time
    the model does not predict (a speculative proposer's), left out of the whole
    run's speed and of every window's alike. Empty for a run without a busy step."""
    busy = step_column(steps, "num_reqs") > 0
    if not busy.any():
        return {}
    real = step_column(steps, "latency_s")
    if exclude_s is not None:
        real = real - np.asarray(exclude_s, dtype=np.float64)
    real = real[busy]
    pred = predict_logged_steps(model, steps)[busy]
    speed = float(real.sum() / pred.sum())
    windows = speed_by_window(step_column(steps, "start_s")[busy], real, pred, window_s)
    kept = windows.loc[windows["steps"] >= SPEED_WINDOW_STEPS, "speed"]
    low, high = (float(kept.min()), float(kept.max())) if len(kept) >= 2 else (speed, speed)
    return {"speed_vs_profile": speed, "speed_vs_profile_min": low, "speed_vs_profile_max": high}
