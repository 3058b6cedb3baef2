"""Inter-token gaps of a run's finished requests, pooled for ITL statistics.

A run of a million requests has a hundred million gaps. The pool keeps the
latest million in memory and moves older ones to a file in a temporary folder
(removed with the pool), so its memory does not grow with the run. The
percentiles are exactly ``np.percentile``'s (linear interpolation): over gaps
in memory, numpy's own; over a file, the order statistics are found by radix
selection, four passes over the gaps' bit patterns (which order non-negative
floats as their values), and interpolated as numpy does. The mean is the sum
over pieces (equal to numpy's up to the order of summation).
"""

from __future__ import annotations

import math
import shutil
import tempfile
import weakref
from array import array
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

SPILL_AT = 1 << 20  # gaps kept in memory (8 MiB) before they move to the file
QUANTILES = (50, 90, 99)
_PIECE = 1 << 20  # gaps read back at a time


class PooledGaps:
    """Every gap between consecutive tokens of the requests added, pooled."""

    def __init__(self, spill_at: int = SPILL_AT) -> None:
        self.spill_at = spill_at
        self._pending = array("d")
        self._file: Path | None = None
        self._spilled = 0

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
            np.frombuffer(token_times, np.float64)
            if isinstance(token_times, array)
            else (np.asarray(token_times, dtype=np.float64))
        )
        self._pending.frombytes(np.diff(t).tobytes())
        if len(self._pending) >= self.spill_at:
            self._spill()

    def __len__(self) -> int:
        return self._spilled + len(self._pending)

    def _spill(self) -> None:
        if self._file is None:
            folder = Path(tempfile.mkdtemp(prefix="gaps-"))
            weakref.finalize(self, shutil.rmtree, folder, ignore_errors=True)
            self._file = folder / "gaps.f64"
        with open(self._file, "ab") as f:
            self._pending.tofile(f)
        self._spilled += len(self._pending)
        del self._pending[:]

    def _pieces(self) -> Iterator[np.ndarray]:
        if self._spilled:  # read, not mapped: a mapped file's pages would stay resident
            with open(self._file, "rb") as f:
                for lo in range(0, self._spilled, _PIECE):
                    yield np.fromfile(f, np.float64, count=min(_PIECE, self._spilled - lo))
        if self._pending:
            yield np.frombuffer(self._pending, np.float64)

    def stats(self, name: str = "itl_s") -> dict[str, float]:
        """``<name>_mean``, ``_p50``, ``_p90``, ``_p99`` of the pooled gaps (NaN when none)."""
        keys = [f"{name}_mean", *(f"{name}_p{q}" for q in QUANTILES)]
        n = len(self)
        if n == 0:
            return dict.fromkeys(keys, math.nan)
        if not self._spilled:
            gaps = np.frombuffer(self._pending, np.float64)
            mean = float(gaps.mean())
        else:
            mean = float(sum(piece.sum() for piece in self._pieces()) / n)
        return dict(zip(keys, [mean, *self.percentiles(QUANTILES)], strict=True))

    def percentiles(self, qs: Sequence[float]) -> list[float]:
        """``np.percentile(gaps, qs)`` (linear interpolation) of the pooled gaps."""
        n = len(self)
        if not self._spilled:
            return np.percentile(np.frombuffer(self._pending, np.float64), qs).tolist()
        spans = []
        for q in qs:
            # numpy's virtual index and interpolation for method="linear"
            quantile = np.float64(q) / 100
            virtual = (n - 1) * quantile
            below = min(max(math.floor(virtual), 0), n - 1)
            spans.append((below, min(below + 1, n - 1), np.float64(virtual - math.floor(virtual))))
        values = self._select(sorted({k for lo, hi, _ in spans for k in (lo, hi)}))
        out = []
        for lo, hi, gamma in spans:
            a, b = values[lo], values[hi]
            diff = b - a
            out.append(float(b - diff * (1 - gamma) if gamma >= 0.5 else a + diff * gamma))
        return out

    def _select(self, ranks: list[int]) -> dict[int, np.float64]:
        """The gaps at sorted positions ``ranks``: radix selection, 16 bits of the
        gaps' bit patterns per pass over them (gaps are never negative)."""
        prefix = dict.fromkeys(ranks, 0)  # the bits of each rank's gap found so far
        left = {r: r for r in ranks}  # its position among the gaps with that prefix
        for level in range(4):
            shift = np.uint64(48 - 16 * level)
            hists = {p: np.zeros(1 << 16, dtype=np.int64) for p in set(prefix.values())}
            for piece in self._pieces():
                keys = piece.view(np.uint64)
                for p, hist in hists.items():
                    sel = keys if level == 0 else keys[(keys >> (shift + np.uint64(16))) == p]
                    digits = ((sel >> shift) & np.uint64(0xFFFF)).astype(np.intp)
                    hist += np.bincount(digits, minlength=1 << 16)
            for r in ranks:
                cumulative = np.cumsum(hists[prefix[r]])
                digit = int(np.searchsorted(cumulative, left[r], side="right"))
                left[r] -= int(cumulative[digit - 1]) if digit else 0
                prefix[r] = (prefix[r] << 16) | digit
        return {r: np.array([prefix[r]], dtype=np.uint64).view(np.float64)[0] for r in ranks}
