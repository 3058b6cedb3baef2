"""Per-step records (``steps.csv``), kept compact: a day of simulated steps is
millions of rows.

Times, latencies, KV usage and attention work are stored per step. The integer columns are
stored run-length encoded: a simulator jump over many plain decode steps is one
run, so logging it costs the same as logging one step. Past :data:`SPILL_ROWS`
rows, the rows logged so far move to files in a temporary folder (removed with
the log), so that a long run's steps take disk, not memory.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from array import array
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

SPILL_ROWS = 1 << 20  # rows kept in memory before they move to files

FLOAT_COLUMNS = ("start_s", "latency_s", "kv_usage", "kv_tokens", "attn_pairs", "max_kv")
INT_COLUMNS = (
    "replica",
    "num_reqs",
    "num_prefill_tokens",
    "num_decode_tokens",
    "num_waiting",
    "num_running",
    "num_preempted",
    "num_spec_reqs",
    "num_draft_tokens",
    "num_accepted_tokens",
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
    "num_spec_reqs",
    "num_draft_tokens",
    "num_accepted_tokens",
)


def step_row(res) -> tuple:
    """A ``StepResult``'s row: :meth:`StepLog.add`'s arguments after the replica (an
    engine process sends these to its parent)."""
    return (
        res.start_s, res.latency_s, res.num_reqs, res.num_prefill_tokens,
        res.num_decode_tokens, res.kv_usage, res.num_waiting, res.num_running,
        res.num_preempted, res.kv_tokens, res.attn_pairs, res.max_kv, res.num_spec_reqs,
        res.num_draft_tokens, res.num_accepted_tokens,
    )  # fmt: skip


class StepLog:
    """One row per engine step, in both modes."""

    def __init__(self, spill_rows: int = SPILL_ROWS) -> None:
        self._floats = {name: array("d") for name in FLOAT_COLUMNS}
        self._ints = {name: array("q") for name in INT_COLUMNS}
        self._runs = array("q")  # how many consecutive rows share the integer values
        self.spill_rows = spill_rows
        self._dir: Path | None = None  # the spilled rows' files, once there are any
        self._spilled_rows = self._spilled_runs = 0

    def __len__(self) -> int:
        return self._spilled_rows + len(self._floats["start_s"])

    def _spill(self) -> None:
        """Move the rows in memory to the end of the files."""
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="steplog-"))
            weakref.finalize(self, shutil.rmtree, self._dir, ignore_errors=True)
        for name, values in (*self._floats.items(), *self._ints.items(), ("runs", self._runs)):
            with open(self._dir / name, "ab") as f:
                values.tofile(f)
        self._spilled_rows += len(self._floats["start_s"])
        self._spilled_runs += len(self._runs)
        for values in (*self._floats.values(), *self._ints.values(), self._runs):
            del values[:]

    def _values(self, name: str, lo: int, hi: int) -> np.ndarray:
        """Stored values ``lo:hi`` of a column (rows of a float column, runs of an
        integer one, or the run lengths: ``"runs"``), from the files and memory."""
        if name == "runs":
            memory, spilled = self._runs, self._spilled_runs
        else:
            memory = self._floats.get(name, self._ints.get(name))
            spilled = self._spilled_rows if name in self._floats else self._spilled_runs
        dtype = np.float64 if name in self._floats else np.int64
        parts = []
        if lo < spilled:  # read, not mapped: a mapped file's pages would stay resident
            count = min(hi, spilled) - lo
            parts.append(np.fromfile(self._dir / name, dtype, count=count, offset=lo * 8))
        if hi > spilled:
            parts.append(np.frombuffer(memory, dtype=dtype)[max(lo - spilled, 0) : hi - spilled])
        if not parts:
            return np.empty(0, dtype=dtype)
        return parts[0].copy() if len(parts) == 1 else np.concatenate(parts)

    def _num_runs(self) -> int:
        return self._spilled_runs + len(self._runs)

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
        num_spec_reqs: int = 0,
        num_draft_tokens: int = 0,
        num_accepted_tokens: int = 0,
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
            num_spec_reqs,
            num_draft_tokens,
            num_accepted_tokens,
        )
        if len(f["start_s"]) >= self.spill_rows:
            self._spill()

    def add_result(self, replica: int, res) -> None:
        """A row from an engine step's ``StepResult``."""
        self.add(replica, *step_row(res))

    def _run(
        self,
        n,
        replica,
        reqs,
        prefill,
        decode,
        waiting,
        running,
        preempted,
        verifying=0,
        drafts=0,
        accepted=0,
    ) -> None:
        i = self._ints
        self._runs.append(n)
        i["replica"].append(replica)
        i["num_reqs"].append(reqs)
        i["num_prefill_tokens"].append(prefill)
        i["num_decode_tokens"].append(decode)
        i["num_waiting"].append(waiting)
        i["num_running"].append(running)
        i["num_preempted"].append(preempted)
        i["num_spec_reqs"].append(verifying)
        i["num_draft_tokens"].append(drafts)
        i["num_accepted_tokens"].append(accepted)

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
        else:
            if k > 1:
                self._run(k - 1, replica, num_reqs, 0, num_reqs, num_waiting, num_reqs, 0)
            self._run(1, replica, num_reqs, 0, num_reqs, num_waiting, num_running_after, 0)
        if len(f["start_s"]) >= self.spill_rows:
            self._spill()

    def column(self, name: str) -> np.ndarray:
        """One column, one value per step, in logging order."""
        return self._rows(name, 0, len(self), self._run_ends())

    def _run_ends(self) -> tuple[np.ndarray, np.ndarray]:
        """Every run's length and the row after it (run i holds rows
        ``ends[i] - lengths[i]`` to ``ends[i]``)."""
        lengths = self._values("runs", 0, self._num_runs())
        return lengths, np.cumsum(lengths)

    def _rows(self, name: str, lo: int, hi: int, runs: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
        """Rows ``lo:hi`` of one column, in logging order (``runs``: :meth:`_run_ends`)."""
        if name in self._floats:
            return self._values(name, lo, hi)
        if hi <= lo:
            return np.empty(0, dtype=np.int64)
        lengths, ends = runs
        first, last = np.searchsorted(ends, [lo, hi - 1], side="right")
        span = slice(int(first), int(last) + 1)
        cut = np.minimum(ends[span], hi) - np.maximum(ends[span] - lengths[span], lo)
        return np.repeat(self._values(name, span.start, span.stop), cut)

    def pieces(
        self, names: Sequence[str], rows: int = SPILL_ROWS
    ) -> Iterator[dict[str, np.ndarray]]:
        """The columns ``names``, up to ``rows`` rows at a time, in logging order
        (for sums and maxima over a log too long to hold whole)."""
        runs = self._run_ends()  # read once, not per piece and column
        for lo in range(0, len(self), rows):
            hi = min(lo + rows, len(self))
            yield {name: self._rows(name, lo, hi, runs) for name in names}

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

        replicas = self._values("replica", 0, self._num_runs())
        if len(replicas) and replicas.min() != replicas.max():
            yield self.to_frame()
            return
        for piece in self.pieces(ORDER, rows):
            yield pd.DataFrame(piece)
