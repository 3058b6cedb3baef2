"""Inter-token gaps of a run's finished requests, pooled for ITL statistics.

A run of a million requests has a hundred million gaps, but far fewer distinct
ones: every request in a step's batch gets its token at the step's end, so the
requests of one batch share their gaps. The pool keeps gaps as they come and,
once they are many, folds them into distinct values with counts; the
statistics are those of the whole pooled sample (percentiles exactly
``np.percentile``'s linear interpolation; the mean up to summation order).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Sequence

import numpy as np

FOLD_AT = 1 << 20  # gaps kept as they came before folding (8 MiB)
QUANTILES = (50, 90, 99)


class PooledGaps:
    """Every gap between consecutive tokens of the requests added, pooled."""

    def __init__(self, fold_at: int = FOLD_AT) -> None:
        self.fold_at = fold_at
        self._pending = array("d")
        self._values = np.empty(0, dtype=np.float64)  # distinct, ascending
        self._counts = np.empty(0, dtype=np.int64)

    @classmethod
    def of(cls, token_times: Iterable[Sequence[float] | None]) -> PooledGaps:
        pool = cls()
        for times in token_times:
            pool.add(times)
        return pool

    def add(self, token_times: Sequence[float] | None) -> None:
        """The gaps of one request whose tokens came at ``token_times`` (None: none came)."""
        if token_times is None or len(token_times) < 2:
            return
        t = (
            np.frombuffer(token_times, dtype=np.float64)
            if isinstance(token_times, array)
            else (np.asarray(token_times, dtype=np.float64))
        )
        self._pending.frombytes(np.diff(t).tobytes())
        if len(self._pending) >= self.fold_at:
            self._fold()

    def __len__(self) -> int:
        return len(self._pending) + int(self._counts.sum())

    def _fold(self) -> None:
        if not self._pending:
            return
        pending = np.frombuffer(self._pending, dtype=np.float64)
        pending, counts = np.unique(pending, return_counts=True)
        self._pending = array("d")
        values = np.concatenate([self._values, pending])
        counts = np.concatenate([self._counts, counts])
        self._values, inverse = np.unique(values, return_inverse=True)
        self._counts = np.bincount(inverse, weights=counts).astype(np.int64)

    def stats(self, name: str = "itl_s") -> dict[str, float]:
        """``<name>_mean``, ``_p50``, ``_p90``, ``_p99`` of the pooled gaps (NaN when none)."""
        self._fold()
        keys = [f"{name}_mean", *(f"{name}_p{q}" for q in QUANTILES)]
        n = int(self._counts.sum())
        if n == 0:
            return dict.fromkeys(keys, math.nan)
        mean = float(np.dot(self._values, self._counts) / n)
        return dict(zip(keys, [mean, *self.percentiles(QUANTILES)], strict=True))

    def percentiles(self, qs: Sequence[float]) -> list[float]:
        """``np.percentile(sample, qs)`` (linear interpolation) of the pooled sample."""
        self._fold()
        n = int(self._counts.sum())
        ends = np.cumsum(self._counts)  # sorted positions [ends[i-1], ends[i]) hold values[i]

        def at(k: int) -> float:
            return float(self._values[np.searchsorted(ends, k, side="right")])

        out = []
        for q in qs:
            # numpy's virtual index and interpolation for method="linear"
            quantile = np.float64(q) / 100
            virtual = n * quantile + (1 + quantile * (1 - 1 - 1)) - 1
            below = min(max(math.floor(virtual), 0), n - 1)
            gamma = np.float64(virtual - math.floor(virtual))
            lo, hi = np.float64(at(below)), np.float64(at(min(below + 1, n - 1)))
            diff = hi - lo
            out.append(float(hi - diff * (1 - gamma) if gamma >= 0.5 else lo + diff * gamma))
        return out
