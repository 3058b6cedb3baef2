"""A reference probe on another core: the machine's speed beside a run or a profile.

Where a machine's cores slow down and speed up together (a shared VM's vCPUs
often do), a loop on a core the engine does not use says how fast the engine's
core runs at every moment of a run, without timing the run's own steps and
without waiting for its idle gaps (``hardware.reference_cpus``). Where some of
the host's contention falls on one core alone it says less (docs/fidelity.md
has how well it tracked on the 2-core VM).

:class:`ReferenceProbe` runs that loop in a child process pinned to the
reference cores: the :class:`~testbed.profiling.probes.IdleProbe` step on the
engine's model, repeated back to back, each execution timed on the system-wide
monotonic clock (``time.perf_counter``). The samples are read beside a busy
engine only (:func:`busy_cover`): a real run knows its busy time from its own
step log; the profiler, which also steps its engines outside a replay, records
when its executors executed (:meth:`ReferenceProbe.watch`). A run at 70% load is busy
for part of the time where the profiler is busy throughout; on a machine whose
cores share more (hyperthreads of one core), load on the engine's core would
move the reference.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import signal
import time
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import pandas as pd

from testbed.engine.device import pick_device
from testbed.engine.factory import build_engine
from testbed.profiling.probes import IdleProbe

BUSY_COVER = 0.9  # a sample counts as beside a busy engine when at least this much of it was
READY_TIMEOUT_S = 600.0  # the child builds an engine; on a slow VM that can take minutes


def _loop(args, model, cpus: list[int], ready, stop, conn) -> None:
    """The child: build the engine pinned to ``cpus``, then time the probe step
    back to back until ``stop``; send (end time, seconds) rows."""
    # Ctrl-C reaches the whole process group: the parent stops the loop (and
    # keeps its samples) when its own run ends, interrupted or not.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    args = replace(args, cpus=list(cpus), threads=1, enable_prefix_caching=False, num_kv_blocks=64)
    _, executor, _ = build_engine(args, model=model)
    probe = IdleProbe(args, executor)
    ready.set()
    rows: list[tuple[float, float]] = []
    while not stop.is_set():
        seconds = probe.measure()
        rows.append((time.perf_counter(), seconds))
    conn.send(np.asarray(rows, dtype=float).reshape(-1, 2))
    conn.close()


class ReferenceProbe:
    """``with ReferenceProbe(args, model, cpus) as ref: ...`` runs the reference
    loop for the block's duration; afterwards ``ref.samples`` holds (end time,
    seconds) rows on ``time.perf_counter``'s clock and ``ref.busy`` the
    intervals the watched executors were executing (:meth:`watch`: the profiler's;
    a real run takes them from its step log instead)."""

    def __init__(self, args, model, cpus: Sequence[int]) -> None:
        if not cpus:
            raise ValueError("hardware.reference_cpus: give at least one core number")
        device = pick_device(args.device)
        if device.type != "cpu":
            raise ValueError(
                f"hardware.reference_cpus: the reference probe follows a CPU engine's "
                f"machine; this engine runs on {device}"
            )
        if args.cpus is not None and set(cpus) & set(args.cpus):
            raise ValueError(
                f"hardware.reference_cpus={list(cpus)} overlaps hardware.cpus={list(args.cpus)}: "
                "the reference must run on cores the engine does not use"
            )
        self.args, self.model, self.cpus = args, model, [int(c) for c in cpus]
        self.samples = np.zeros((0, 2))
        self.busy: list[tuple[float, float]] = []
        self._proc = None

    def watch(self, executor) -> None:
        """Record every ``executor.execute`` call's interval in :attr:`busy`."""
        execute = executor.execute

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return execute(*a, **k)
            finally:
                self.busy.append((t0, time.perf_counter()))

        executor.execute = timed

    def __enter__(self) -> ReferenceProbe:
        ctx = mp.get_context("spawn")
        self._ready, self._stop = ctx.Event(), ctx.Event()
        self._conn, child = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=_loop,
            args=(self.args, self.model, self.cpus, self._ready, self._stop, child),
            daemon=True,
        )
        self._proc.start()
        child.close()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self._ready.wait(1.0):
            if not self._proc.is_alive() or time.monotonic() > deadline:
                self._proc.kill()
                raise RuntimeError(
                    f"reference probe on cores {self.cpus} did not start "
                    f"(exit code {self._proc.exitcode})"
                )
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        try:
            if self._conn.poll(60.0):
                self.samples = self._conn.recv()
        except EOFError:  # the loop died without sending: no samples, said by the caller
            pass
        self._proc.join(10.0)
        if self._proc.is_alive():
            self._proc.kill()


def busy_cover(samples: np.ndarray, busy: Sequence[tuple[float, float]]) -> np.ndarray:
    """For each sample (end time, seconds), the fraction of its interval during
    which one of the ``busy`` intervals (sorted, not overlapping) was running."""
    if not len(samples):
        return np.zeros(0)
    if not len(busy):
        return np.zeros(len(samples))
    b = np.asarray(busy, dtype=float)
    # Busy time elapsed up to each boundary: a piecewise-linear, non-decreasing function.
    widths = b[:, 1] - b[:, 0]
    before = np.concatenate([[0.0], np.cumsum(widths)[:-1]])
    x = np.column_stack([b[:, 0], b[:, 1]]).ravel()
    y = np.column_stack([before, before + widths]).ravel()
    end, seconds = samples[:, 0], samples[:, 1]
    covered = np.interp(end, x, y) - np.interp(end - seconds, x, y)
    return np.clip(covered / np.maximum(seconds, 1e-12), 0.0, 1.0)


def sample_table(
    samples: np.ndarray, busy: Sequence[tuple[float, float]], origin: float = 0.0
) -> pd.DataFrame:
    """``reference_probe.csv``: every sample (end time, seconds) with its end time
    from ``origin`` (a perf_counter reading: a run's clock zero), its seconds and
    the fraction of it beside the busy engine (``busy``: intervals on the same
    clock as the times, after ``origin`` is taken off)."""
    samples = np.asarray(samples, dtype=float).reshape(-1, 2)
    on_clock = np.column_stack([samples[:, 0] - origin, samples[:, 1]])
    return pd.DataFrame(
        dict(time_s=on_clock[:, 0], probe_s=on_clock[:, 1], busy=busy_cover(on_clock, busy))
    )


def beside_busy(table: pd.DataFrame) -> pd.DataFrame:
    """The rows of a :func:`sample_table` taken beside the busy engine (:data:`BUSY_COVER`)."""
    return table[table["busy"] >= BUSY_COVER]


def busy_median(table: pd.DataFrame) -> tuple[float, int]:
    """(median seconds of a :func:`sample_table`'s samples beside the busy engine,
    their number); NaN, 0 where there are none."""
    busy = beside_busy(table)["probe_s"]
    return (float(busy.median()), len(busy)) if len(busy) else (float("nan"), 0)


def reference_key(header: dict[str, str], phase: str = "replay") -> str:
    """The key of a profile header's reference probe during ``phase`` ("grid" or
    "replay", as :func:`reference_header` writes them), or of the whole profile's
    (``reference_probe_s``) where the header does not split it: tables measured
    before the split, or merged from passes that did not all have it."""
    key = f"reference_probe_{phase}_s"
    return key if key in header else "reference_probe_s"


def reference_header(
    reference: ReferenceProbe | None, replay_start: float = math.inf, replay_end: float = math.inf
) -> dict:
    """The profile header's ``reference_probe_s`` (none without the reference),
    and the same median over the grid's samples (those ending before
    ``replay_start``) and over the replay's (ending from ``replay_start`` to
    ``replay_end``; ``time.perf_counter`` readings): ``reference_probe_replay_s``
    is the machine's speed while the steps that set the latency model's level
    ran (:class:`~testbed.sim.profile_model.ProfileModel`). The idle tail and the
    closing speed probe count in the whole median only."""
    if reference is None:
        return {}
    table = sample_table(reference.samples, reference.busy)
    median, n = busy_median(table)
    header = {
        "reference_probe_s": f"{median:.6g} (median of {n} samples beside the busy engine, "
        f"of {len(reference.samples)}, on cores {reference.cpus})"
    }
    t = table["time_s"]
    grid, replay = table[t < replay_start], table[(t >= replay_start) & (t < replay_end)]
    for phase, rows in (("grid", grid), ("replay", replay)):
        median, n = busy_median(rows)
        if n:
            header[f"reference_probe_{phase}_s"] = f"{median:.6g} (median of {n} samples)"
    return header
