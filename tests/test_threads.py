"""The engine's threads follow the cores other processes leave free
(testbed/threads.py), and a real run says what it ran on."""

from __future__ import annotations

import math
import time

import pytest

from testbed.host import usable_cpus
from testbed.threads import INTERVAL_S, ThreadGovernor, cpu_ticks


class Machine:
    """Two cores whose use by other processes the test sets; this process is busy
    on as many cores as it has threads."""

    def __init__(self) -> None:
        self.now, self.busy, self.own, self.others = 0.0, 0.0, 0.0, 0.0
        self.threads = 2

    def clock(self) -> float:
        return self.now

    def read(self, cpus) -> tuple[float, float]:
        return self.busy, self.own

    def set_threads(self, n: int) -> None:
        self.threads = n

    def run(self, seconds: float, governor: ThreadGovernor) -> None:
        """``seconds`` of steps, the governor looking before each (every 0.1 s)."""
        for _ in range(round(seconds / 0.1)):
            governor.adjust()
            self.now += 0.1
            own = min(self.threads, 2 - min(self.others, 1.0)) * 0.1
            self.own += own
            self.busy += own + self.others * 0.1


def test_a_busy_core_takes_a_thread_away_and_gives_it_back_when_free():
    m = Machine()
    g = ThreadGovernor(2, cpus={0, 1}, read=m.read, clock=m.clock, set_threads=m.set_threads)
    m.run(3, g)
    assert m.threads == 2 and g.changes == 0  # quiet: every core
    m.others = 1.0  # another process spins on a core
    m.run(4 * INTERVAL_S, g)
    assert m.threads == 1 and g.fewest == 1
    m.others = 0.02  # it ended; the machine's own background remains
    m.run(4 * INTERVAL_S, g)
    assert m.threads == 2 and g.changes == 2
    assert g.settings() == {"threads_fewest": 1, "thread_changes": 2}


def test_one_look_at_a_passing_job_changes_nothing():
    m = Machine()
    g = ThreadGovernor(2, cpus={0, 1}, read=m.read, clock=m.clock, set_threads=m.set_threads)
    m.run(1, g)
    m.others = 1.0
    m.run(INTERVAL_S, g)  # one look sees it
    m.others = 0.0
    m.run(2, g)
    assert m.threads == 2 and g.changes == 0


def test_never_fewer_than_one_thread_nor_more_than_it_was_given():
    m = Machine()
    g = ThreadGovernor(1, cpus={0, 1}, read=m.read, clock=m.clock, set_threads=m.set_threads)
    assert m.threads == 1  # set at once: an earlier engine may have left another count
    m.others = 2.0  # both cores taken
    m.run(3, g)
    assert m.threads == 1 and g.changes == 0


def test_unreadable_counters_leave_the_threads_as_they_are():
    m = Machine()
    nan = float("nan")
    g = ThreadGovernor(
        2, cpus={0, 1}, read=lambda cpus: (nan, nan), clock=m.clock, set_threads=m.set_threads
    )
    m.others = 1.0
    m.run(3, g)
    assert m.threads == 2 and g.changes == 0


def test_the_counters_count_this_process_within_all_busy_time():
    busy, own = cpu_ticks(usable_cpus())
    if math.isnan(busy):
        pytest.skip("no /proc/stat here (not Linux)")
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:  # CPU time of our own
        pass
    busy2, own2 = cpu_ticks(usable_cpus())
    assert own2 - own >= 0.2 and busy2 - busy >= own2 - own - 0.05
