"""The machine's speed over simulated time: a factor on every step's latency.

A speed trace is a CSV with columns ``start_s`` and ``speed``: from each row's
``start_s`` (seconds on the run's clock) until the next row's, every step that
starts then lasts ``speed`` times what the latency model predicts (2.0: the
machine runs steps half as fast as profiled). Before the first row the factor
is 1. ``mode.latency_scale`` multiplies the whole trace, or is a trace of its own
(one factor throughout) where no CSV is given. Uses: a machine's speed as it
wandered during a real run (the fidelity experiment measures it window by
window, so that the simulator can be compared with the real engine apart from
the machine), or interference scripted by hand (a co-located job slowing the
accelerator by 30% for two minutes).
"""

from __future__ import annotations

import bisect
import csv
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from traces.schema import TraceError

COLUMNS = ("start_s", "speed")


def first_bad(starts: Sequence[float], speeds: Sequence[float]) -> tuple[int, str, str] | None:
    """The first entry that is not a valid trace row (its index, field and what is
    wrong), or None: starts finite and increasing, speeds finite and positive."""
    for i, (t, s) in enumerate(zip(starts, speeds, strict=True)):
        if not math.isfinite(t) or (i and t <= starts[i - 1]):
            return i, "start_s", f"{t} must be finite and larger than the previous row's"
        if not (math.isfinite(s) and s > 0):
            return i, "speed", f"{s} must be positive"
    return None


class SpeedTrace:
    """Piecewise-constant latency factors over time (see the module docstring)."""

    def __init__(
        self,
        starts: Sequence[float],
        speeds: Sequence[float],
        source: str = "",
        before: float = 1.0,
    ) -> None:
        name = source or "a speed trace"
        if len(starts) != len(speeds) or not starts:
            raise ValueError(f"{name}: needs one speed per start, at least one")
        self.starts = [float(t) for t in starts]
        self.speeds = [float(s) for s in speeds]
        self.source = source
        bad = first_bad(self.starts, self.speeds)
        if bad is not None:
            i, field, problem = bad
            raise ValueError(f"{name}: row {i + 1}, field {field}: {problem}")
        self.before = float(before)  # the factor before the first row
        self.min_factor = min(self.before, *self.speeds)

    @classmethod
    def from_csv(cls, path: str | Path) -> SpeedTrace:
        """Read a trace; a bad file, row or field is named in the error (rows
        counted as in request traces: data rows from 1, with their line)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"speed trace {path} does not exist")
        with path.open(newline="") as f:  # blank and comment lines skipped, numbers kept
            kept = [(n, text) for n, text in enumerate(f, 1) if text.strip() and text[0] != "#"]
        reader = csv.DictReader(text for _, text in kept)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or ())]
        if missing:
            raise TraceError(
                str(path), f"no column {', '.join(missing)} (needs {COLUMNS})", row="header"
            )
        starts, speeds = [], []
        for i, row in enumerate(reader):
            for field, values in zip(COLUMNS, (starts, speeds), strict=True):
                try:
                    values.append(float(row[field]))
                except (TypeError, ValueError):
                    raise TraceError(
                        str(path),
                        f"not a number: {row[field]!r}",
                        row=i + 1,
                        line=kept[i + 1][0],
                        field=field,
                    ) from None
        if not starts:
            raise TraceError(str(path), "no rows")
        bad = first_bad(starts, speeds)
        if bad is not None:
            i, field, problem = bad
            raise TraceError(str(path), problem, row=i + 1, line=kept[i + 1][0], field=field)
        return cls(starts, speeds, source=str(path))

    @classmethod
    def from_windows(cls, width_s: float, speeds: Sequence[float]) -> SpeedTrace:
        """Windows of ``width_s`` seconds from 0, one speed each."""
        return cls([i * width_s for i in range(len(speeds))], speeds)

    @classmethod
    def constant(cls, factor: float) -> SpeedTrace:
        """One factor for every step (``mode.latency_scale`` alone)."""
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"latency_scale must be positive, got {factor}")
        return cls([0.0], [factor], before=factor)

    def scaled(self, factor: float) -> SpeedTrace:
        """This trace with every factor, the one before its first row too, times
        ``factor`` (``mode.latency_scale`` on top of a CSV trace)."""
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"latency_scale must be positive, got {factor}")
        speeds = [factor * x for x in self.speeds]
        return SpeedTrace(self.starts, speeds, self.source, before=factor * self.before)

    def to_csv(self, path: str | Path, note: str = "") -> Path:
        path = Path(path)
        lines = [f"# {line}" for line in note.splitlines()] + [",".join(COLUMNS)]
        lines += [f"{t:.6f},{s:.6f}" for t, s in zip(self.starts, self.speeds, strict=True)]
        path.write_text("\n".join(lines) + "\n")
        return path

    def describe(self) -> str:
        return (
            f"speed trace {Path(self.source).name or 'in memory'} ({len(self.speeds)} rows, "
            f"{min(self.speeds):.3g}-{max(self.speeds):.3g})"
        )

    def _segment(self, t: float) -> tuple[float, float]:
        """The factor at time ``t`` and when it next changes."""
        i = bisect.bisect_right(self.starts, t)
        factor = self.speeds[i - 1] if i else self.before
        until = self.starts[i] if i < len(self.starts) else math.inf
        return factor, until

    def at(self, t: float) -> float:
        """The factor for a step that starts at ``t``."""
        return self._segment(t)[0]

    def scale(self, t: float, latencies: np.ndarray) -> np.ndarray:
        """Consecutive steps' latencies from ``t`` on, each times the factor at its
        own start: the same floats as stepping one at a time with :meth:`at`
        (the start times are sequential sums, as the simulator's clock adds them)."""
        out = np.empty_like(latencies)
        i, n = 0, len(latencies)
        while i < n:
            factor, until = self._segment(t)
            part = factor * latencies[i:]
            ends = np.empty(len(part) + 1)
            ends[0] = t
            ends[1:] = part
            np.cumsum(ends, out=ends)  # ends[j] is when step i + j starts (j < len)
            # Steps that start before the factor changes take this factor.
            m = 1 + int(np.searchsorted(ends[1:-1], until, side="left"))
            out[i : i + m] = part[:m]
            t, i = float(ends[m]), i + m
        return out
