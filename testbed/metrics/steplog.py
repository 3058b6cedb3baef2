"""Per-step records, kept as columns (a day of simulated steps is millions of rows)."""

from __future__ import annotations

from array import array
from itertools import repeat

COLUMNS = (
    ("replica", "i"),
    ("start_s", "d"),
    ("latency_s", "d"),
    ("num_reqs", "i"),
    ("num_prefill_tokens", "i"),
    ("num_decode_tokens", "i"),
    ("kv_usage", "d"),
    ("num_waiting", "i"),
    ("num_running", "i"),
    ("num_preempted", "i"),
)


class StepLog:
    """One row per engine step, in both modes (``steps.csv``)."""

    def __init__(self) -> None:
        self.columns = {name: array(code) for name, code in COLUMNS}

    def __len__(self) -> int:
        return len(self.columns["start_s"])

    def add(
        self,
        replica: int,
        start_s: float,
        latency_s: float,
        num_reqs: int,
        num_prefill_tokens: int,
        num_decode_tokens: int,
        kv_usage: float,
        num_waiting: int,
        num_running: int,
        num_preempted: int,
    ) -> None:
        c = self.columns
        c["replica"].append(replica)
        c["start_s"].append(start_s)
        c["latency_s"].append(latency_s)
        c["num_reqs"].append(num_reqs)
        c["num_prefill_tokens"].append(num_prefill_tokens)
        c["num_decode_tokens"].append(num_decode_tokens)
        c["kv_usage"].append(kv_usage)
        c["num_waiting"].append(num_waiting)
        c["num_running"].append(num_running)
        c["num_preempted"].append(num_preempted)

    def add_decode_steps(
        self,
        replica: int,
        starts,
        latencies,
        num_reqs: int,
        kv_usages,
        num_waiting: int,
        num_running_after: int,
    ) -> None:
        """Rows for plain decode steps applied at once (the simulator's fast path);
        the per-step columns come as float64 numpy arrays. Requests may finish in
        the last step: ``num_running_after`` is then fewer than ``num_reqs``."""
        k = len(starts)
        c = self.columns
        c["start_s"].frombytes(starts.tobytes())
        c["latency_s"].frombytes(latencies.tobytes())
        c["kv_usage"].frombytes(kv_usages.tobytes())
        for name, value in (
            ("replica", replica),
            ("num_reqs", num_reqs),
            ("num_prefill_tokens", 0),
            ("num_decode_tokens", num_reqs),
            ("num_waiting", num_waiting),
            ("num_running", num_reqs),
            ("num_preempted", 0),
        ):
            c[name].extend(repeat(value, k))
        c["num_running"][-1] = num_running_after

    def to_frame(self):
        """The rows in time order (replicas' steps interleaved by start time)."""
        import numpy as np
        import pandas as pd

        frame = pd.DataFrame({name: col for name, col in self.columns.items()})
        if frame["replica"].nunique() > 1:
            # The fast path logs a replica's jump at once: order rows canonically.
            order = np.lexsort((frame["replica"].to_numpy(), frame["start_s"].to_numpy()))
            frame = frame.iloc[order].reset_index(drop=True)
        return frame
