"""Per-step records (``steps.csv``), kept compact: a day of simulated steps is
millions of rows.

Times, latencies, KV usage and attention work are stored per step. The integer columns are
stored run-length encoded: a simulator jump over many plain decode steps is one
run, so logging it costs the same as logging one step.
"""

from __future__ import annotations

from array import array

import numpy as np

FLOAT_COLUMNS = ("start_s", "latency_s", "kv_usage", "kv_tokens", "attn_pairs", "max_kv")
INT_COLUMNS = (
    "replica",
    "num_reqs",
    "num_prefill_tokens",
    "num_decode_tokens",
    "num_waiting",
    "num_running",
    "num_preempted",
)
ORDER = (
    "replica",
    "start_s",
    "latency_s",
    "num_reqs",
    "num_prefill_tokens",
    "num_decode_tokens",
    "kv_usage",
    "num_waiting",
    "num_running",
    "num_preempted",
    "kv_tokens",
    "attn_pairs",
    "max_kv",
)


class StepLog:
    """One row per engine step, in both modes."""

    def __init__(self) -> None:
        self._floats = {name: array("d") for name in FLOAT_COLUMNS}
        self._ints = {name: array("q") for name in INT_COLUMNS}
        self._runs = array("q")  # how many consecutive rows share the integer values

    def __len__(self) -> int:
        return len(self._floats["start_s"])

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
        kv_tokens: float = 0.0,
        attn_pairs: float = 0.0,
        max_kv: float = 0.0,
    ) -> None:
        f = self._floats
        f["start_s"].append(start_s)
        f["latency_s"].append(latency_s)
        f["kv_usage"].append(kv_usage)
        f["kv_tokens"].append(kv_tokens)
        f["attn_pairs"].append(attn_pairs)
        f["max_kv"].append(max_kv)
        self._run(
            1,
            replica,
            num_reqs,
            num_prefill_tokens,
            num_decode_tokens,
            num_waiting,
            num_running,
            num_preempted,
        )

    def add_result(self, replica: int, res) -> None:
        """A row from an engine step's ``StepResult``."""
        self.add(
            replica,
            res.start_s,
            res.latency_s,
            res.num_reqs,
            res.num_prefill_tokens,
            res.num_decode_tokens,
            res.kv_usage,
            res.num_waiting,
            res.num_running,
            res.num_preempted,
            res.kv_tokens,
            res.attn_pairs,
            res.max_kv,
        )

    def _run(self, n, replica, reqs, prefill, decode, waiting, running, preempted) -> None:
        i = self._ints
        self._runs.append(n)
        i["replica"].append(replica)
        i["num_reqs"].append(reqs)
        i["num_prefill_tokens"].append(prefill)
        i["num_decode_tokens"].append(decode)
        i["num_waiting"].append(waiting)
        i["num_running"].append(running)
        i["num_preempted"].append(preempted)

    def add_decode_steps(
        self,
        replica: int,
        starts: np.ndarray,
        latencies: np.ndarray,
        num_reqs: int,
        kv_usages: np.ndarray,
        num_waiting: int,
        num_running_after: int,
        kv_tokens: np.ndarray,
        max_kv: np.ndarray,
    ) -> None:
        """Rows for plain decode steps applied at once (the simulator's fast path);
        the per-step columns come as float64 arrays. Requests may finish in the
        last step: ``num_running_after`` is then fewer than ``num_reqs``."""
        k = len(starts)
        f = self._floats
        f["start_s"].frombytes(starts.tobytes())
        f["latency_s"].frombytes(latencies.tobytes())
        f["kv_usage"].frombytes(kv_usages.tobytes())
        kv = kv_tokens.astype(np.float64).tobytes()
        f["kv_tokens"].frombytes(kv)
        f["attn_pairs"].frombytes(kv)  # one query per request: a pair per K/V entry
        f["max_kv"].frombytes(max_kv.astype(np.float64).tobytes())
        if num_running_after == num_reqs:
            self._run(k, replica, num_reqs, 0, num_reqs, num_waiting, num_reqs, 0)
            return
        if k > 1:
            self._run(k - 1, replica, num_reqs, 0, num_reqs, num_waiting, num_reqs, 0)
        self._run(1, replica, num_reqs, 0, num_reqs, num_waiting, num_running_after, 0)

    def column(self, name: str) -> np.ndarray:
        """One column, one value per step, in logging order."""
        if name in self._floats:
            return np.frombuffer(self._floats[name], dtype=np.float64).copy()
        runs = np.frombuffer(self._runs, dtype=np.int64)
        return np.repeat(np.frombuffer(self._ints[name], dtype=np.int64), runs)

    def to_frame(self):
        """The rows in time order (replicas' steps interleaved by start time)."""
        import pandas as pd

        frame = pd.DataFrame({name: self.column(name) for name in ORDER})
        if len(frame) and frame["replica"].nunique() > 1:
            # The fast path logs a replica's jump at once: order rows canonically.
            order = np.lexsort((frame["replica"].to_numpy(), frame["start_s"].to_numpy()))
            frame = frame.iloc[order].reset_index(drop=True)
        return frame

    def frames(self, rows: int = 1 << 20):
        """:meth:`to_frame` in pieces of up to ``rows`` rows, so that writing a long
        log takes memory per piece (one replica's rows are in time order as
        logged; several replicas' are ordered whole)."""
        import pandas as pd

        replicas = self._ints["replica"]
        if len(replicas) and min(replicas) != max(replicas):
            yield self.to_frame()
            return
        lengths = np.frombuffer(self._runs, dtype=np.int64)
        ends = np.cumsum(lengths)  # run i holds rows [ends[i] - lengths[i], ends[i])
        for start in range(0, len(self), rows):
            end = min(start + rows, len(self))
            first, last = np.searchsorted(ends, [start, end - 1], side="right")
            span = slice(first, last + 1)
            cut = np.minimum(ends[span], end) - np.maximum(ends[span] - lengths[span], start)
            columns = {}
            for name in ORDER:
                if name in self._floats:
                    columns[name] = np.frombuffer(self._floats[name], np.float64)[start:end]
                else:
                    values = np.frombuffer(self._ints[name], np.int64)[span]
                    columns[name] = np.repeat(values, cut)
            yield pd.DataFrame(columns)
