"""The real engine's CPU threads: as many as the cores other processes leave free.

torch's intra-op threads, its matrix library's and the C++ attention kernel's
are one OpenMP pool whose threads meet at a barrier after every parallel region,
many times a layer. OpenMP's default lets them spin a while before they sleep,
which a decode step of a few milliseconds needs (with a pool that sleeps at once,
``OMP_WAIT_POLICY=PASSIVE``, small-batch decode steps take 1.3-1.5x as long).
But where another process holds one of the cores, a thread that shares its core
is descheduled for whole time slices while its partner spins at the barrier:
every region waits for it, and the engine slows several times more than losing
that core costs. So the engine runs one thread per core that others leave free
(:class:`ThreadGovernor`, between steps), and keeps OpenMP's default policy
unless the user sets ``OMP_WAIT_POLICY``.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import Any

from testbed.host import usable_cpus

INTERVAL_S = 0.5  # how often the governor looks at the cores' use
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def cpu_ticks(cpus: set[int]) -> tuple[float, float]:
    """Seconds of CPU time spent busy on ``cpus`` by every process (``/proc/stat``:
    user, nice, system, irq, softirq; not idle, iowait or a hypervisor's steal)
    and by this process, all its threads (``/proc/self/stat``); (nan, nan) where
    the files cannot be read (not Linux)."""
    try:
        with open("/proc/stat") as f:
            lines = [line.split() for line in f if line.startswith("cpu")]
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()  # after the command's name
    except OSError:
        return float("nan"), float("nan")
    busy = 0
    for fields in lines:
        name = fields[0]
        if name != "cpu" and int(name[3:]) in cpus:
            user, nice, system, _idle, _iowait, irq, softirq = map(int, fields[1:8])
            busy += user + nice + system + irq + softirq
    return busy * TICK_S, (int(own[11]) + int(own[12])) * TICK_S  # utime, stime


class ThreadGovernor:
    """Sets torch's intra-op threads to the cores of this process's affinity that
    other processes left free over the last :data:`INTERVAL_S` (rounded; between
    1 and ``most``), once two looks in a row agree, so that a passing job does
    not make it flap. :meth:`adjust` is called before each step; it looks only
    when the interval has passed."""

    def __init__(
        self,
        most: int,
        cpus: set[int] | None = None,
        read: Callable[[set[int]], tuple[float, float]] = cpu_ticks,
        clock: Callable[[], float] = time.monotonic,
        set_threads: Callable[[int], None] | None = None,
    ) -> None:
        if set_threads is None:
            import torch

            set_threads = torch.set_num_threads
        self.most = self.current = self.fewest = most
        self.cpus = cpus if cpus is not None else usable_cpus()
        self.read, self.clock, self.set_threads = read, clock, set_threads
        set_threads(most)  # an earlier engine's governor may have left fewer
        self.changes = 0
        self._pending: int | None = None
        self._last = (clock(), *read(self.cpus))

    def adjust(self) -> None:
        now = self.clock()
        then, busy_then, own_then = self._last
        if now - then < INTERVAL_S:
            return
        busy, own = self.read(self.cpus)
        self._last = (now, busy, own)
        others = ((busy - busy_then) - (own - own_then)) / (now - then)
        if math.isnan(others):  # the counters cannot be read: keep what there is
            return
        target = min(self.most, max(1, round(len(self.cpus) - others)))
        if target == self.current or target != self._pending:
            self._pending = target if target != self.current else None
            return
        self.set_threads(target)
        self.current, self._pending = target, None
        self.fewest = min(self.fewest, target)
        self.changes += 1

    def settings(self) -> dict[str, Any]:
        """What the run's steps ran on (``metrics.json``)."""
        return {"threads_fewest": self.fewest, "thread_changes": self.changes}


_MOST: int | None = None  # torch's threads when the first governor was made


def default_threads() -> int:
    """torch's threads before any governor of this process changed them (torch's
    default: one per core, or ``OMP_NUM_THREADS``)."""
    global _MOST
    if _MOST is None:
        import torch

        _MOST = torch.get_num_threads()
    return _MOST


def governor() -> ThreadGovernor:
    """A governor over :func:`default_threads`."""
    return ThreadGovernor(default_threads())


def thread_settings(
    governor: ThreadGovernor | None = None, threads: int | None = None
) -> dict[str, Any]:
    """What a real run's CPU work ran on: torch's intra-op threads (the most, with
    the governor's fewest and its changes where it ran; ``threads``: each engine
    process's, where they ran elsewhere), its inter-op threads and the OpenMP
    pool's wait policy (``metrics.json``)."""
    import torch

    if governor is not None:
        most = governor.most
    else:
        most = threads if threads is not None else torch.get_num_threads()
    return {
        "threads": most,
        **(governor.settings() if governor is not None else {}),
        "interop_threads": torch.get_num_interop_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "openmp default"),
    }
