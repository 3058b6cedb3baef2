"""The run directory: ``metrics.json``, ``requests.csv``, ``steps.csv`` and plots.

The same files in both modes (see DESIGN.md), so that ``experiments/`` can join a
simulated and a real run of the same trace request by request.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from testbed.metrics.steplog import StepLog


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN; absent values are null
    if isinstance(v, np.generic):
        return _jsonable(v.item())
    return v


def write_metrics(run_dir: Path, metrics: dict[str, Any]) -> Path:
    path = run_dir / "metrics.json"
    path.write_text(json.dumps({k: _jsonable(v) for k, v in metrics.items()}, indent=2) + "\n")
    return path


def write_tables(run_dir: Path, requests: pd.DataFrame, steps: StepLog) -> None:
    requests.to_csv(run_dir / "requests.csv", index=False)
    frame = steps.to_frame()
    frame.insert(0, "step", np.arange(len(frame)))
    frame.to_csv(run_dir / "steps.csv", index=False, float_format="%.9g")


def write_idle_probe(run_dir: Path, samples: list[tuple[float, float]]) -> None:
    """``idle_probe.csv``: when (run clock) the idle probe ran and how long it took."""
    frame = pd.DataFrame(samples, columns=["time_s", "probe_s"])
    frame.to_csv(run_dir / "idle_probe.csv", index=False, float_format="%.6g")


def _binned(t: np.ndarray, v: np.ndarray, bins: int = 400) -> tuple[np.ndarray, np.ndarray]:
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
            ax.plot(*_binned(t, v), lw=1)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("time (s)")
    axes[0].set_title(title)
    fig.tight_layout()
    paths.append(run_dir / "timeline.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
