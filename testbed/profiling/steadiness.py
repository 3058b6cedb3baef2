"""Whether the machine's speed held still while a profile was measured.

The profiler repeats a probe throughout: the idle probe after every grid point
and, with ``hardware.reference_cpus``, the reference probe beside the busy
engine. Cut in time order into stretches, a steady machine's probe has the same
median in every stretch up to the probe's own repeat noise; a machine whose
speed moved (a co-tenant, another job on the same cores) has slow and fast
stretches. :func:`speed_moved` is how much slower the slowest stretch ran than
the fastest; over :data:`SPEED_MOVED_WARN` the profile mixes the machine's
speeds and the profiler says so (docs/simulator.md has the numbers behind it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

STRETCHES = 8  # at most this many stretches of the probe's samples, in time order
# Samples per stretch at least: the idle probe's single samples scatter by 5-10%
# on a quiet machine, with outliers, and a median of fewer moves with them.
PER_STRETCH = 8
# The slowest stretch's median over the fastest's, minus one, over which the
# machine's speed moved: about three times what the idle probe's own repeat noise
# gives on a quiet pass (its samples in shuffled order: a median of 4-7%), and
# under the 25-44% of every committed CPU pass whose fit was worse than 7%
# (docs/simulator.md has the passes).
SPEED_MOVED_WARN = 0.2


def samples_per_pause(points: int) -> int:
    """Idle-probe samples to take after each of a grid's ``points``, so that even a
    short grid has :data:`STRETCHES` stretches of :data:`PER_STRETCH` (one each
    for a grid of that many points or more)."""
    return max(1, math.ceil(STRETCHES * PER_STRETCH / max(points, 1)))


def speed_moved(samples: Sequence[float]) -> tuple[float, int] | None:
    """(how much longer the probe took in its slowest stretch than in its fastest,
    as a fraction; the number of stretches) over ``samples`` (seconds, in the
    order they were taken), cut into at most :data:`STRETCHES` stretches of at
    least :data:`PER_STRETCH`; None with too few samples for two stretches."""
    seconds = np.asarray(samples, dtype=float)
    n = min(STRETCHES, len(seconds) // PER_STRETCH)
    if n < 2:
        return None
    medians = [float(np.median(s)) for s in np.array_split(seconds, n)]
    return max(medians) / min(medians) - 1, n


def speed_header(idle: Sequence[float], reference: Sequence[float] | None = None) -> dict:
    """The profile header's ``speed_moved``: the larger :func:`speed_moved` of the
    idle probe's samples between grid points and (where it ran) the reference
    probe's beside the busy engine, first, then each probe's; ``n/a`` first where
    neither has enough samples."""
    parts, values = [], []
    for name, samples in (
        ("idle probe between grid points", idle),
        ("reference probe beside the busy engine", reference),
    ):
        if samples is None:
            continue
        moved = speed_moved(samples)
        if moved is None:
            parts.append(f"{name}: {len(samples)} samples, too few")
        else:
            values.append(moved[0])
            parts.append(f"{name} {moved[0]:.3g} over {moved[1]} stretches of {len(samples)}")
    first = f"{max(values):.3g}" if values else "n/a"
    detail = "; ".join(parts)
    return {
        "speed_moved": f"{first} (the slowest stretch's median over the fastest's, minus one: "
        f"{detail}; over {SPEED_MOVED_WARN:g} counts as the machine's speed moving)"
    }


def speed_line(moved: float) -> str:
    """What a profile's ``speed_moved`` says: one line, a WARNING over
    :data:`SPEED_MOVED_WARN` naming how much and what to do."""
    stretches = "in its slowest stretch {} in its fastest"
    if moved >= 1:  # "8800% longer" reads worse than "89 times as long"
        how = f"its probe took {moved + 1:.3g} times as long " + stretches.format("as")
    elif moved > 0:
        how = f"its probe took {moved:.0%} longer " + stretches.format("than")
    else:
        how = "its probe took as long in every stretch"
    if moved <= SPEED_MOVED_WARN:
        return f"machine's speed steady while profiled: {how} (under {SPEED_MOVED_WARN:.0%})"
    return (
        f"WARNING: the machine's speed moved while it was profiled: {how} "
        f"(over {SPEED_MOVED_WARN:.0%}). The profile mixes the machine's speeds, and "
        "simulations from it may be off by as much. Profile again on a quiet machine "
        "(nothing else running on its cores)."
    )
