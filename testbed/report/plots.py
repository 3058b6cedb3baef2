"""A run's plots: TTFT and TPOT CDFs, and queue length, batch size and KV usage
over time (written to the run directory and logged to W&B); and the binned
series those are drawn from (``timeline.csv``, which W&B and the sweep
dashboard read too)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from testbed.metrics.steplog import StepLog


def binned(
    steps: StepLog, names: Sequence[str], bins: int = 400
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Step columns ``names`` over time: their means in ``bins`` bins of start time
    (a million steps do not fit a plot), or every step where there are fewer.
    Read a piece of the log at a time: a long log is not held whole."""
    if len(steps) <= bins:
        return steps.column("start_s"), {n: steps.column(n).astype(np.float64) for n in names}
    first, last = math.inf, -math.inf
    for piece in steps.pieces(["start_s"]):
        first, last = min(first, piece["start_s"].min()), max(last, piece["start_s"].max())
    edges = np.linspace(first, last, bins + 1)
    counts = np.zeros(bins, dtype=np.int64)
    sums = {n: np.zeros(bins) for n in names}
    for piece in steps.pieces(["start_s", *names]):
        idx = np.clip(np.digitize(piece["start_s"], edges) - 1, 0, bins - 1)
        counts += np.bincount(idx, minlength=bins)
        for n in names:
            sums[n] += np.bincount(idx, weights=piece[n].astype(np.float64), minlength=bins)
    keep = counts > 0
    centers = ((edges[:-1] + edges[1:]) / 2)[keep]
    return centers, {n: sums[n][keep] / counts[keep] for n in names}


# The step columns over time that a run directory keeps, binned (timeline.csv)
TIMELINE = ("num_waiting", "num_running", "num_reqs", "kv_usage", "latency_s")
TIMELINE_BINS = 500


def timeline(steps: StepLog, bins: int = TIMELINE_BINS) -> pd.DataFrame:
    """:data:`TIMELINE`'s columns over time: their means in ``bins`` bins of step
    start time (``time_s``: the bin's centre), or every step where fewer."""
    times, series = binned(steps, TIMELINE, bins=bins)
    return pd.DataFrame({"time_s": times, **series})


def write_plots(
    run_dir: Path, requests: pd.DataFrame, series: pd.DataFrame, title: str
) -> list[Path]:
    """TTFT and TPOT CDFs; queue length, batch size and KV usage over time (from
    :func:`timeline`'s ``series``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for col, label in (("ttft_s", "TTFT (s)"), ("tpot_s", "TPOT (s)")):
        v = np.sort(requests[col].dropna().to_numpy())
        fig, ax = plt.subplots(figsize=(5, 3.5))
        if v.size:
            ax.plot(v, np.arange(1, v.size + 1) / v.size)
        ax.set(xlabel=label, ylabel="fraction of requests", title=f"{label} CDF: {title}")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        paths.append(run_dir / f"{col.removesuffix('_s')}_cdf.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    shown = (("num_waiting", "queue length"), ("num_reqs", "batch size"), ("kv_usage", "KV usage"))
    fig, axes = plt.subplots(3, 1, figsize=(7, 6), sharex=True)
    for ax, (name, label) in zip(axes, shown, strict=True):
        if len(series):
            ax.plot(series["time_s"], series[name], lw=1)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("time (s)")
    axes[0].set_title(title)
    fig.tight_layout()
    paths.append(run_dir / "timeline.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
