"""The profiler: measures the real engine's steps on the machine at hand and
writes the profile table the simulator reads (``profiles/<hardware>/<model>.csv``).

For each point of a grid of batch compositions (:mod:`~testbed.profiling.grid`:
decodes at several batch sizes and context lengths, prefills of several
lengths, from scratch and after a cached prefix, and prefills mixed with
decodes) it builds exactly that batch in a real engine and times ``repeats``
steps of it after warm-up steps (:mod:`~testbed.profiling.measure`: the whole
``EngineCore.step`` cycle and its parts); then it replays a short synthetic
trace and records every step (:mod:`~testbed.profiling.replay_steps`). One row
per grid point or replayed step holds the step features the latency models
use and the latency; the header (:mod:`~testbed.profiling.header`) says where,
when and how.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

from testbed.engine.args import EngineArgs
from testbed.engine.factory import build_engine
from testbed.profile_table import REPLAY_GRIDS, write_profile
from testbed.profiling.grid import Point, fit_args, grid_points
from testbed.profiling.header import profile_header
from testbed.profiling.measure import measure_point
from testbed.profiling.probes import (
    IDLE_TAIL,
    PROBE,
    IdleProbe,
    idle_probe_rows,
    probe_headers,
    speed_probe,
)
from testbed.profiling.progress import duration, point_work, seconds_left
from testbed.profiling.reference_probe import (
    ReferenceProbe,
    beside_busy,
    reference_header,
    sample_table,
)
from testbed.profiling.replay_steps import SPARSE_RATE, measure_replay, replay_kv_blocks
from testbed.profiling.steadiness import samples_per_pause, speed_header
from testbed.threads import default_threads


def run_profile(
    args: EngineArgs,
    grid: str | Iterable[tuple[int, ...]],
    repeats: int = 5,
    warmup: int = 2,
    out_dir: str | Path = "profiles",
    hardware: str = "cpu",
    model_name: str | None = None,
    model=None,
    replay_requests: int = 80,
    sparse_requests: int = 0,
    max_grid_s: float | None = None,
    reference_cpus: Iterable[int] | None = None,
) -> Path:
    """Measure every grid point, then every step of a short synthetic replay (and
    of ``sparse_requests`` more at a low rate: :func:`measure_replay`), and
    write ``<out_dir>/<hardware>/<model>.csv``.

    Interrupted (Ctrl-C, SIGTERM where :func:`testbed.signals.interrupt_on_sigterm`
    is installed) or failing part-way, it writes what it measured to
    ``<model>.partial.csv`` (its header says how far it got; the simulator never
    reads it) and re-raises. ``grid`` is a name (see :func:`grid_points`) or
    the points themselves. With ``max_grid_s``, no grid point is started after
    that many seconds of the grid (the first always is): the rest are skipped,
    the replay still runs and the profile is written, its header naming the
    points skipped (for a machine lent for minutes, whose speed is not known
    beforehand). With ``reference_cpus``, a
    :class:`~testbed.profiling.reference_probe.ReferenceProbe` runs on those cores
    throughout, and the header's ``reference_probe_s`` is its median beside the
    busy engine, which runs with ``hardware.reference_cpus`` compare with theirs.

    After each grid point it prints how far the grid has got, the time spent and
    about how long the rest should take; the header's ``speed_moved`` is how much
    the machine's speed moved meanwhile (:mod:`~testbed.profiling.steadiness`:
    the idle probe, taken :func:`samples_per_pause` times after each point, and
    the reference probe where it ran) and ``duration_s`` how long it all took."""
    started = time.perf_counter()
    # One thread count throughout (no governor): the engine's most, which a
    # governed run on a quiet machine uses.
    args = replace(args, threads=args.threads or default_threads())
    if isinstance(grid, str):
        grid_name, grid = grid_points(grid, args.device)
    else:
        grid_name = "given"
    points = [Point(*g) for g in grid]
    # The replay runs the engine as configured (its batch and token limits, prefix
    # caching): the mixes of steps that engine's runs produce.
    replay_args = replace(args)
    fit_args(args, points + [Point(*g) for g in PROBE], repeats, warmup)
    engine, executor, cfg = build_engine(args, model=model)
    executor.record_timings = True
    name = model_name or Path(args.model).name
    probes = [speed_probe(engine, executor, cfg.vocab_size)]
    rows: list[dict] = []
    done = 0  # grid points measured
    grid_note = f"{grid_name} ({len(points)} points)"  # the header's "grid"
    took: dict[str, float] = {}  # seconds of each phase, as far as it got

    def durations() -> dict:
        """The header's ``duration_s``: the whole profile's seconds and its phases'."""
        phases = ", ".join(f"{k} {v:.0f}" for k, v in took.items())
        return {"duration_s": f"{time.perf_counter() - started:.0f} ({phases})"}

    def speed() -> dict:
        """The header's ``speed_moved``, from every probe sample taken so far."""
        idle = [r["latency_s"] for r in rows if r.get("grid") == "between_points"]
        beside = None
        if reference is not None and len(reference.samples):
            busy = beside_busy(sample_table(reference.samples, reference.busy))
            beside = busy["probe_s"].tolist()
        return speed_header(idle, beside)

    def write(filename: str, **extra: str) -> Path:
        """The table of what was measured, under ``<out_dir>/<hardware>/``."""
        path = Path(out_dir) / hardware / filename
        header = profile_header(args, replay_args, executor, hardware, name, repeats, warmup)
        header["grid"] = grid_note
        header.update(extra, **probe_headers(probes, rows), **speed(), **durations())
        write_profile(path, header, rows)
        return path

    reference = ReferenceProbe(args, model, list(reference_cpus)) if reference_cpus else None
    replay = [math.inf, math.inf]  # when the replay started and ended (perf_counter)
    running = contextlib.ExitStack()
    if reference is not None:
        running.enter_context(reference)
        reference.watch(executor)
    # The points after a cached prefix run on an engine like the grid's with
    # prefix caching on, sharing its weights.
    cached = (engine, executor)
    if any(p.prefix_tokens for p in points):
        caching = replace(args, enable_prefix_caching=True)
        cached = build_engine(caching, model=model, weights=executor.model)[:2]
        cached[1].record_timings = True
        if reference is not None:
            reference.watch(cached[1])
    try:
        idle_probe = IdleProbe(args, executor)
        pauses = samples_per_pause(len(points))
        work = [point_work(p, repeats + warmup) for p in points]
        spent: list[float] = []  # each measured point's seconds, its idle probe's with it
        print(f"  grid {grid_note}, then the replay ...", flush=True)
        grid_start = time.perf_counter()
        for point in points:
            if done and max_grid_s is not None and time.perf_counter() - grid_start > max_grid_s:
                break
            t0 = time.perf_counter()
            on = cached if point.prefix_tokens else (engine, executor)
            r = measure_point(*on, point, repeats, warmup, cfg.vocab_size, done)
            rows.append(r)
            samples = [idle_probe.after_pause() for _ in range(pauses)]
            rows += idle_probe_rows(samples, "between_points")
            spent.append(time.perf_counter() - t0)
            took["grid"] = time.perf_counter() - grid_start
            done += 1
            left = seconds_left(work[:done], spent, sum(work[done:]), len(points) - done)
            pace = f"{duration(took['grid'])} in"
            pace += f", about {duration(left)} more" if left and done < len(points) else ""
            after = f" after {point.prefix_tokens} cached" if point.prefix_tokens else ""
            after += f", {point.drafts} drafts each" if point.drafts else ""
            after += f" in {point.prefills} prompts" if point.prefills > 1 else ""
            print(
                f"  [{done}/{len(points)}] decodes {point.decode_batch:>3} x ctx "
                f"{point.context:>5}, prefill {point.prefill_tokens:>5}{after}: "
                f"{r['latency_s'] * 1e3:8.2f} ms | {pace}",
                flush=True,
            )
        print(f"  grid: {done} points in {duration(took.get('grid', 0.0))}", flush=True)
        del cached
        if done < len(points):
            skipped = ", ".join(p.label() for p in points[done:])
            grid_note = (
                f"{grid_name} ({done} of {len(points)} points; skipped at the {max_grid_s:g} s "
                "limit, as decodes x context + prefill[/prompts][@cached prefix][~drafts]: "
                f"{skipped})"
            )
            print(f"  grid stopped at its {max_grid_s:g} s limit: {grid_note}", flush=True)
        print(f"  replaying {replay_requests} synthetic requests for realistic step mixes ...")
        # A fresh engine, as every run starts with: the grid has reordered the free
        # blocks, and K/V gathered through scattered block tables cost more on a CPU.
        # It shares the grid engine's weights; on a GPU, whose memory the grid
        # engine's cache already holds part of, it gets a cache that holds every
        # replayed request at once instead of what is left of the card.
        if executor.device.type != "cpu" and replay_args.num_kv_blocks is None:
            replay_args.num_kv_blocks = replay_kv_blocks(replay_requests, args.block_size)
        replay_engine, replay_executor, _ = build_engine(
            replay_args, model=model, weights=executor.model
        )
        if reference is not None:
            reference.watch(replay_executor)
        replay[0] = time.perf_counter()  # the reference's phases: the grid before it
        measure_replay(replay_engine, replay_requests, cfg.vocab_size, idle_probe, rows)
        if sparse_requests:
            print(f"  and {sparse_requests} at {SPARSE_RATE:g} req/s for small batches ...")
            measure_replay(
                replay_engine, sparse_requests, cfg.vocab_size, idle_probe, rows,
                seed=4321, rate=SPARSE_RATE, name="calibration-sparse", grid="replay_sparse",
            )  # fmt: skip
        replay[1] = time.perf_counter()
        took["replay"] = replay[1] - replay[0]
        print(f"  replayed in {duration(took['replay'])}", flush=True)
        # Then the engine idle, as between a trace's requests: the probe at its cadence.
        rows += idle_probe_rows(
            (idle_probe.after_pause() for _ in range(IDLE_TAIL)), "after_replay"
        )
        del replay_engine
        probes.append(speed_probe(engine, executor, cfg.vocab_size))
    except (KeyboardInterrupt, Exception) as e:
        why = "interrupted" if isinstance(e, KeyboardInterrupt) else f"failed ({e!r})"
        replayed = sum(r["grid"] in REPLAY_GRIDS for r in rows)
        partial = f"{why} after {done} of {len(points)} grid points and {replayed} replay steps"
        running.close()
        header = reference_header(reference, *replay)
        path = write(f"{name}.partial.csv", partial=partial, **header)
        print(f"profiler {partial}: wrote what it measured to {path}", flush=True)
        raise
    running.close()
    path = write(f"{name}.csv", **reference_header(reference, *replay))
    print(f"profiled in {duration(time.perf_counter() - started)}", flush=True)
    return path
