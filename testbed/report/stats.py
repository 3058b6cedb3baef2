"""Run-to-run variation: a metric's mean over seeds with a 95% confidence
interval (Student's t), or, under :data:`MIN_FOR_CI` seeds, its spread (lowest
to highest), since an interval from so few samples says little; and whether two
conditions differ beyond their intervals."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MIN_FOR_CI = 5  # seeds from which a t interval is given instead of the spread
# Student's t, two-sided 95% (the 0.975 quantile), by degrees of freedom 1-30.
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t975(dof: int) -> float:
    """The two-sided 95% quantile of Student's t with ``dof`` degrees of freedom
    (the normal's 1.96 past 30, where the table ends; 2.042 at 30 is within 4%)."""
    if dof < 1:
        raise ValueError(f"dof={dof}: needs at least 1")
    return _T975[dof - 1] if dof <= len(_T975) else 1.96


@dataclass(frozen=True)
class Estimate:
    """A metric over seeds: the mean and an interval around it (``kind``: ``ci95``
    or ``range``; ``single`` for one seed, where ``lo == hi == mean``)."""

    mean: float
    lo: float
    hi: float
    n: int
    kind: str

    def text(self, fmt: str = ".4g") -> str:
        if self.n == 0:
            return "-"
        if self.kind == "single":
            return f"{self.mean:{fmt}}"
        if self.kind == "ci95":
            return f"{self.mean:{fmt}} ± {(self.hi - self.lo) / 2:{fmt}}"
        return f"{self.mean:{fmt}} [{self.lo:{fmt}}, {self.hi:{fmt}}]"


def estimate(values: Sequence[float]) -> Estimate:
    """The mean of ``values`` (NaN and None left out) with its 95% interval, or its
    spread under :data:`MIN_FOR_CI` values."""
    v = np.array([x for x in values if x is not None], dtype=float)
    v = v[~np.isnan(v)]
    n = len(v)
    if n == 0:
        return Estimate(math.nan, math.nan, math.nan, 0, "single")
    mean = float(v.mean())
    if n == 1:
        return Estimate(mean, mean, mean, 1, "single")
    if n < MIN_FOR_CI:
        return Estimate(mean, float(v.min()), float(v.max()), n, "range")
    half = t975(n - 1) * float(v.std(ddof=1)) / math.sqrt(n)
    return Estimate(mean, mean - half, mean + half, n, "ci95")


def separated(a: Estimate, b: Estimate) -> bool:
    """Whether two estimates' intervals do not overlap (a conservative test: two
    95% intervals that do not overlap differ at well under 5%); never for a
    single value, which states no variation."""
    if a.kind == "single" or b.kind == "single" or a.n == 0 or b.n == 0:
        return False
    return a.hi < b.lo or b.hi < a.lo
