"""Service-level objectives of the deployment search: targets for TTFT and TPOT at
a percentile, and whether a run meets one.

An SLO is written ``name:ttft_s:tpot_s`` with an optional ``@percentile``
(``tight:0.5:0.03@p99``; p99 by default), or as a mapping with the same fields.
A run meets it when every request was served, the engine kept up with the
arrivals (``metrics.json``'s ``overloaded`` is not true: above its capacity a
short trace ends before the queue it builds breaks a loose SLO, so a rate
that only the trace's end lets through is not one the deployment sustains),
and the run's TTFT and TPOT at the percentile (``ttft_s_p99``, ``tpot_s_p99``)
are within the targets.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from testbed.errors import InputError
from testbed.metrics.summary import STATISTICS

PERCENTILES = STATISTICS  # an SLO is on a statistic metrics.json gives of each latency
_SPEC = re.compile(r"(?P<name>[A-Za-z_][\w-]*):(?P<ttft>[^:@]+):(?P<tpot>[^:@]+)(@(?P<pct>\w+))?")


@dataclass(frozen=True)
class SLO:
    """Targets (seconds) for TTFT and TPOT at one percentile."""

    name: str
    ttft_s: float
    tpot_s: float
    percentile: str = "p99"

    def __post_init__(self) -> None:
        if self.percentile not in PERCENTILES:
            raise ValueError(
                f"percentile {self.percentile!r} is not one of {', '.join(PERCENTILES)}"
            )
        for field in ("ttft_s", "tpot_s"):
            value = getattr(self, field)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{field}={value!r} must be a number of seconds > 0")

    @property
    def label(self) -> str:
        """``tight (TTFT 0.5 s, TPOT 30 ms at p99)``."""
        tpot_ms = self.tpot_s * 1e3
        return f"{self.name} (TTFT {self.ttft_s:g} s, TPOT {tpot_ms:g} ms at {self.percentile})"

    def latencies(self, metrics: Mapping[str, Any]) -> tuple[float, float]:
        """The run's TTFT and TPOT at this SLO's percentile (NaN where absent)."""
        return (
            _number(metrics.get(f"ttft_s_{self.percentile}")),
            _number(metrics.get(f"tpot_s_{self.percentile}")),
        )

    def met_by(self, metrics: Mapping[str, Any]) -> bool:
        """Whether a run's ``metrics.json`` meets this SLO: every request served,
        the engine not overloaded, TTFT and TPOT at the percentile within the
        targets (NaN misses)."""
        ttft, tpot = self.latencies(metrics)
        return (
            served_all(metrics)
            and metrics.get("overloaded") is not True
            and ttft <= self.ttft_s
            and tpot <= self.tpot_s
        )


def served_all(metrics: Mapping[str, Any]) -> bool:
    """Every request of the run finished (none rejected, none left unfinished)."""
    return metrics.get("num_finished") == metrics.get("num_requests") and not metrics.get(
        "num_rejected"
    )


def _number(v: Any) -> float:
    return math.nan if v is None else float(v)


def parse_slo(spec: str | Mapping[str, Any], where: str) -> SLO:
    """An SLO from its text (``name:ttft_s:tpot_s[@pNN]``) or mapping (``name``,
    ``ttft_s``, ``tpot_s``, optional ``percentile``); ``where`` names the field in
    the error a bad one raises."""
    if isinstance(spec, Mapping):
        fields = dict(spec)
        unknown = sorted(set(fields) - {"name", "ttft_s", "tpot_s", "percentile"})
        if unknown:
            raise InputError(
                f"{where}.{unknown[0]}: no such field of an SLO (name, ttft_s, tpot_s, percentile)"
            )
        missing = [k for k in ("name", "ttft_s", "tpot_s") if k not in fields]
        if missing:
            raise InputError(f"{where}: an SLO needs {missing[0]}")
    else:
        m = _SPEC.fullmatch(str(spec).strip())
        if m is None:
            raise InputError(
                f"{where}={spec!r}: not an SLO; write name:ttft_s:tpot_s[@percentile], "
                "e.g. tight:0.5:0.03@p99"
            )
        fields = {"name": m["name"], "ttft_s": m["ttft"], "tpot_s": m["tpot"]}
        if m["pct"]:
            fields["percentile"] = m["pct"]
    try:
        for key in ("ttft_s", "tpot_s"):
            fields[key] = float(fields[key])
        return SLO(**fields)
    except (TypeError, ValueError) as e:
        raise InputError(f"{where}={spec!r}: {e}") from e


def parse_slos(specs: Any, where: str = "slos") -> list[SLO]:
    """Every SLO of a list (:func:`parse_slo`), their names distinct."""
    if isinstance(specs, str | Mapping) or not hasattr(specs, "__iter__"):
        raise InputError(f"{where}: a list of SLOs, e.g. [tight:0.5:0.03@p99, loose:2:0.1@p99]")
    slos = [parse_slo(s, f"{where}[{i}]") for i, s in enumerate(specs)]
    if not slos:
        raise InputError(f"{where}: no SLO given; the search needs at least one")
    names = [s.name for s in slos]
    if dup := sorted({n for n in names if names.count(n) > 1}):
        raise InputError(f"{where}: SLO name {dup[0]!r} is given twice")
    return slos
