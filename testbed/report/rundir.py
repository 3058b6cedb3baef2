"""The run directory's files: ``metrics.json``, ``requests.csv``, ``steps.csv``,
and the probes' samples where a real run took them.

The same files in both modes, so that ``experiments/`` can join a simulated and
a real run of the same trace request by request (``docs/outputs.md``).
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


def write_reference_probe(run_dir: Path, table: pd.DataFrame) -> None:
    """``reference_probe.csv``: the reference probe's samples (see
    ``testbed.profiling.reference_probe.sample_table``)."""
    table.to_csv(run_dir / "reference_probe.csv", index=False, float_format="%.6g")
