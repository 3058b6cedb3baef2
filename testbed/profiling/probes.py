"""Probes of the machine's speed: a fixed handful of steps timed before and after
a profile (:func:`speed_probe`), and one decode step timed while an engine is
idle (:class:`IdleProbe`: between the profiler's points and, with
``mode.idle_probe=true``, in a real run's gaps between requests)."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Iterable
from dataclasses import replace

from testbed.engine.args import EngineArgs
from testbed.engine.factory import build_engine
from testbed.profiling.grid import Point, fit_args
from testbed.profiling.measure import measure_point, start_decoders, sync


def idle_probe_rows(seconds: Iterable[float], grid: str) -> list[dict]:
    """The profile's rows for idle-probe samples (not steps: the fit skips them)."""
    return [dict(kind="idle_probe", grid=grid, latency_s=s, repeats=1) for s in seconds]


# A fixed handful of steps whose summed median latency tracks the machine's speed
# (see speed_probe): one decode, a small and a larger decode batch, one prefill.
PROBE = [(1, 256, 0), (4, 512, 0), (16, 512, 0), (0, 0, 512)]


def speed_probe(engine, executor, vocab: int, repeats: int = 15, warmup: int = 3) -> float:
    """Seconds the :data:`PROBE` steps take together (each its median), a few
    seconds' measurement. The profile records it as it is measured; measured again
    before a run on a machine whose speed drifts (a shared VM's), the ratio says
    how much slower or faster the machine is now than when it was profiled."""
    return sum(
        measure_point(engine, executor, Point(*g), repeats, warmup, vocab, 1000 + i)["latency_s"]
        for i, g in enumerate(PROBE)
    )


# The step the idle probe repeats: a decode batch of typical size and context.
IDLE_PROBE = (8, 256, 0)
IDLE_TAIL = 40  # idle-probe samples after the profiler's replay, an idle engine's
IDLE_GRIDS = ("replay_gaps", "after_replay")  # samples with the engine idle after a replay


class IdleProbe:
    """One fixed decode step (:data:`IDLE_PROBE`) on an engine's own model, timed
    while that engine is idle: trace replay samples it in the gaps between
    requests (``mode.idle_probe=true``) and the profiler while it measures.

    On a machine whose speed drifts (a shared VM's: 10-20% within an hour), the
    ratio of a run's median sample to the profile's says how much slower or faster
    the machine ran during the run than when it was profiled, without timing the
    run's own steps and without running beside them (samples are taken only where
    the next arrival is ``min_gap_s`` away, at most one per ``every_s``).

    It shares the engine's weights, with its own small KV cache, scheduler and
    sampler; the same scheduled step is executed again and again (its blocks are
    assigned once), so the engine being measured is never touched.

    A record of the machine during a run: too coarse to correct a simulation to
    within a few percent (docs/fidelity.md)."""

    def __init__(
        self,
        args: EngineArgs,
        executor,
        point: tuple[int, int, int] = IDLE_PROBE,
        min_gap_s: float = 0.05,
        every_s: float = 0.25,
        warmup: int = 3,
    ) -> None:
        p = Point(*point)
        args = replace(args, enable_prefix_caching=False, num_kv_blocks=None)
        fit_args(args, [p], 1, 1)
        cfg = executor.model.config
        engine, self.executor, _ = build_engine(
            args, model=(cfg, None, "idle-probe"), weights=executor.model
        )
        self.executor.threads = executor.threads  # one governor for the run's threads
        start_decoders(engine, p, 8, random.Random(4321), cfg.vocab_size, "probe")
        so = engine.scheduler.schedule(engine.clock())
        if so.num_prefill_tokens or so.num_decode_tokens != p.decode_batch:
            raise RuntimeError(f"idle probe: expected {p.decode_batch} decodes, scheduled {so}")
        self.executor.execute(so)  # assigns its blocks; every later execution reuses them
        self.step = replace(
            so, new_req_ids=set(), new_block_ids={}, preempted_req_ids=[], finished_req_ids=[]
        )
        self.min_gap_s, self.every_s = min_gap_s, every_s
        for _ in range(warmup):
            self.measure()

    def measure(self) -> float:
        """Seconds one execution of the probe step takes now."""
        t0 = time.perf_counter()
        self.executor.execute(self.step)
        sync(self.executor.device)
        return time.perf_counter() - t0

    def after_pause(self) -> float:
        """:meth:`measure` after ``every_s`` of idling, as replay spaces its samples."""
        time.sleep(self.every_s)
        return self.measure()


def idle_probe_header(rows: list[dict]) -> str:
    """The profile header's ``idle_probe_s``: the median of every sample (between
    grid points, in the replay's gaps and after it), and the medians of the two
    conditions: their difference is the probe's own noise, which bounds how
    exactly it can say the machine's speed."""
    seconds = [r["latency_s"] for r in rows]
    text = f"{statistics.median(seconds):.6g} (median of {len(seconds)} samples"
    for label, grids in (("between grid points", ("between_points",)), ("idle", IDLE_GRIDS)):
        part = [r["latency_s"] for r in rows if r["grid"] in grids]
        if part:
            text += f"; {label} {statistics.median(part):.6g}, {len(part)}"
    return text + ")"


def probe_engine(args: EngineArgs, model=None):
    """An engine set up as the profiler's, for :func:`speed_probe` alone."""
    fit_args(args, [Point(*g) for g in PROBE], 15, 3)
    engine, executor, cfg = build_engine(args, model=model)
    return engine, executor, cfg.vocab_size


def probe_headers(probes: list[float], rows: list[dict]) -> dict:
    """The machine's speed while it was measured (see speed_probe): before the grid
    and after the replay, and their mean; the idle probe's median over every
    sample (kind=idle_probe rows), which a run with mode.idle_probe=true compares
    with its own."""
    each = ", ".join(f"{p:.6g}" for p in probes)
    out = {"speed_probe_s": f"{statistics.fmean(probes):.6g} ({each})"}
    samples = [r for r in rows if r["kind"] == "idle_probe"]
    if samples:
        out["idle_probe_s"] = idle_probe_header(samples)
    return out
