"""A run's plots: TTFT and TPOT CDFs, and queue length, batch size and KV usage
over time (written to the run directory and logged to W&B)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from testbed.metrics.steplog import StepLog


def binned(t: np.ndarray, v: np.ndarray, bins: int = 400) -> tuple[np.ndarray, np.ndarray]:
    """Mean of ``v`` in time bins (a million steps do not fit a plot)."""
    if t.size <= bins:
        return t, v
    edges = np.linspace(t.min(), t.max(), bins + 1)
    idx = np.clip(np.digitize(t, edges) - 1, 0, bins - 1)
    counts = np.bincount(idx, minlength=bins)
    sums = np.bincount(idx, weights=v, minlength=bins)
    keep = counts > 0
    return ((edges[:-1] + edges[1:]) / 2)[keep], sums[keep] / counts[keep]


def write_plots(run_dir: Path, requests: pd.DataFrame, steps: StepLog, title: str) -> list[Path]:
    """TTFT and TPOT CDFs; queue length, batch size and KV usage over time."""
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
    t = steps.column("start_s")
    fig, axes = plt.subplots(3, 1, figsize=(7, 6), sharex=True)
    for ax, (name, label) in zip(
        axes,
        (("num_waiting", "queue length"), ("num_reqs", "batch size"), ("kv_usage", "KV usage")),
        strict=True,
    ):
        v = steps.column(name).astype(np.float64)
        if t.size:
            ax.plot(*binned(t, v), lw=1)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("time (s)")
    axes[0].set_title(title)
    fig.tight_layout()
    paths.append(run_dir / "timeline.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
