"""The profiler: measures the real engine's steps on the machine at hand.

For each point of a grid of batch compositions (decodes at several batch sizes
and context lengths, prefills of several lengths, from scratch and after a
cached prefix, and prefills mixed with decodes) it builds exactly that batch in
a real engine (fcfs; prefix caching off so every token is computed, except for
the points whose prefill follows a prefix the engine holds cached), runs
warm-up steps, then times ``repeats``
steps: the whole ``EngineCore.step`` cycle (scheduling, input preparation, the
forward pass, sampling, accounting), and separately its parts. It writes the
profile table of DESIGN.md: one row per grid point with the step features the
latency models use, the median latency, its spread, and the parts.
"""

from __future__ import annotations

import contextlib
import math
import platform
import random
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd
import torch

from testbed.core import Request, SamplingParams
from testbed.engine.llm import EngineArgs, build_engine, pick_device
from testbed.profiling.reference import ReferenceProbe, busy_median, sample_table
from testbed.sim.latency import (
    FEATURES,
    REPLAY_GRIDS,
    ProfileModel,
    read_profile_header,
    step_features,
)

DECODE_BATCHES = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 32, 64)
CONTEXTS = (64, 256, 1024, 2000)
PREFILLS = (16, 64, 128, 256, 384, 512, 768, 1024, 1536, 2000)


def interleave(first: list, second: list) -> list:
    """Both lists' items, each list in its own order, spread evenly over the
    result, so that any stretch of it holds both in proportion. The profiler
    measures the points in the grid's order, and a VM's speed drifts over the
    minutes a pass takes: measured one kind after the other, decodes and
    prefills see different speeds and the fit's split between their costs is off
    by as much (in experiments/results/fidelity_cpu1_prefix_points/ the idle
    probe ran 9% slower through one pass's decode points than through its
    prefill points, 6% faster in the next pass, and the prefill steps of the
    runs came out 13% under and 3-6% over predicted beside their decode steps)."""
    n, m = len(first), len(second)
    keyed = [((i + 0.5) / n, 0, i) for i in range(n)] + [((j + 0.5) / m, 1, j) for j in range(m)]
    return [(first, second)[k][i] for _, k, i in sorted(keyed)]


# (decode batch, decode context, prefill tokens[, cached prefix tokens]) per
# point (see Point). Every small decode batch: a GEMM of a few rows is not smooth
# in their number (see testbed.sim.latency.DECODE_SIZES). Prefills after a cached
# prefix, as a trace with prefix sharing (Mooncake's conversations, a shared
# system prompt) produces them: from scratch a prefill's attention pairs, KV
# tokens read and longest context all follow from its length, so only these
# points tell the latency model what attention over a long cached context costs
# beside the tokens computed.
PREFIX_POINTS = [(0, 0, p, c) for c in (256, 1024) for p in (64, 256, 768)] + [(4, 256, 256, 1024)]
# Decode points and points with a prefill are interleaved (see interleave).
DEFAULT_GRID = interleave(
    [(b, c, 0) for b in DECODE_BATCHES for c in CONTEXTS],
    [(0, 0, p) for p in PREFILLS]
    + [(b, 256, p) for b in (4, 16) for p in (64, 256, 1024)]
    + PREFIX_POINTS,
)
# A GPU's engine batches up to the engine's max_num_seqs (256) and a step of 8B
# weights costs about as much for 1 as for 100 decodes, so the grid goes on from
# the default one to 256 decodes (with at most 256k cached tokens in all: 34 GB of
# an 8B model's KV cache; any more and the decoders' untimed prefills dominate the
# profiler's time), to contexts of 4096 and to mixes with 64 decodes. The default
# grid's points come first, so that a profile cut short by its time limit
# (``max_grid_s``) has those.
GPU_GRID = DEFAULT_GRID + interleave(
    [(b, c, 0) for b in (128, 256) for c in CONTEXTS if b * c <= 2**18]
    + [(b, 4096, 0) for b in (1, 4, 16, 64)],
    [(64, 256, p) for p in (64, 256, 1024)],
)
GRIDS = {
    "default": DEFAULT_GRID,
    "gpu": GPU_GRID,
    "quick": interleave(
        [(b, 128, 0) for b in (1, 4, 16)],
        [(0, 0, p) for p in (32, 256)] + [(4, 128, 128), (0, 0, 64, 256)],
    ),
}
GRID_CHOICES = ("auto", *GRIDS)  # auto: gpu on a CUDA device, else default


def grid_points(name: str, device: str | None) -> tuple[str, list[tuple[int, ...]]]:
    """The grid called ``name`` (``auto``: ``gpu`` where the engine runs on a GPU,
    ``default`` elsewhere) and its points."""
    if name == "auto":
        name = "default" if pick_device(device).type == "cpu" else "gpu"
    if name not in GRIDS:
        raise ValueError(f"unknown profile grid {name!r}; known: {', '.join(GRID_CHOICES)}")
    return name, GRIDS[name]


# The latency model's median relative error on the table it was fitted to, over
# which a profile's points contradict each other: on a steady 2-core VM 2%; on one
# whose speed swung ~10% within a minute 12-16%
# (experiments/results/fidelity_cpu1_noisy_vm/).
FIT_WARN = 0.05


def fit_line(err: float) -> str:
    """What a latency model's fit to its profile (median relative error) says, with
    a warning when it is over :data:`FIT_WARN`."""
    line = f"latency model fitted to its profile: median relative error {err:.1%}"
    if err > FIT_WARN:
        line += (
            f"\nWARNING: over {FIT_WARN:.0%}: the profile's points disagree with each other, "
            "as when the machine's speed moves while it is measured; simulations from it "
            "will be off by as much. Profile again when the machine is steadier."
        )
    return line


def fit_check(path: str | Path) -> tuple[float, str]:
    """The latency model's fit to a profile table, and :func:`fit_line`."""
    err = ProfileModel(path).fit_rel_error
    return err, fit_line(err)


def report_profile(path: str | Path) -> float:
    """Print where the profile was written and the latency model's fit to it (with
    the warning over :data:`FIT_WARN`); returns the fit."""
    fit, line = fit_check(path)
    print(f"wrote {path}")
    print(line)
    return fit


PREFILL_BUDGET = 2048  # tokens per step beyond the decodes: the largest prefill point fits


class TimedBackend:
    """An attention backend that adds up the time its kernels take."""

    def __init__(self, backend, device: torch.device) -> None:
        self.backend, self.device, self.seconds = backend, device, 0.0

    def _timed(self, name: str):
        fn = getattr(self.backend, name)

        def call(*args, **kwargs):
            sync(self.device)
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            sync(self.device)
            self.seconds += time.perf_counter() - t0
            return out

        return call

    def __getattr__(self, name: str):
        return self._timed(name)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Point:
    """One grid point: ``decode_batch`` requests each decoding after ``context``
    tokens, beside one request prefilling ``prefill_tokens`` tokens after
    ``prefix_tokens`` prompt tokens the engine already holds in its prefix cache
    (a whole number of KV blocks)."""

    decode_batch: int
    context: int
    prefill_tokens: int
    prefix_tokens: int = 0

    def label(self) -> str:
        """``decodes x context + prefill`` (``+ prefill after prefix``)."""
        text = f"{self.decode_batch}x{self.context}+{self.prefill_tokens}"
        return text + (f"@{self.prefix_tokens}" if self.prefix_tokens else "")


# Sampled as trace replay samples (temperature 1, no top-k or top-p), so that the
# profile includes the sampler's cost as the replayed workload pays it.
SAMPLING = dict(temperature=1.0, ignore_eos=True)


def _request(
    rid: str, n: int, out: int, rng: random.Random, vocab: int, prefix: list[int] | None = None
) -> Request:
    """A request of ``n`` random prompt tokens (after ``prefix``) and ``out`` output tokens."""
    return Request(
        request_id=rid,
        prompt_token_ids=(prefix or []) + [rng.randrange(vocab) for _ in range(n)],
        sampling_params=SamplingParams(max_tokens=out, **SAMPLING),
    )


def start_decoders(
    engine, point: Point, out_len: int, rng: random.Random, vocab: int, prefix: str
) -> list[Request]:
    """``point.decode_batch`` requests of ``point.context`` prompt tokens, added
    and prefilled until every one of them decodes (these steps are not timed)."""
    clock = engine.clock
    decodes = [
        _request(f"{prefix}{i}", point.context, out_len, rng, vocab)
        for i in range(point.decode_batch)
    ]
    for r in decodes:
        r.arrival_time = clock()
        engine.add_request(r)
    while any(r.num_computed_tokens < r.num_tokens - 1 or not r.output_token_ids for r in decodes):
        engine.step()
    return decodes


def cache_prefix(engine, point: Point, rng: random.Random, vocab: int) -> list[int]:
    """The ``point.prefix_tokens`` tokens the point's prefills start with, run once
    through ``engine`` (untimed) so that its prefix cache holds them; [] for none."""
    if not point.prefix_tokens:
        return []
    if not engine.scheduler.kv.enable_prefix_caching:
        raise ValueError(f"profiler point {point.label()}: needs an engine with prefix caching")
    first = _request("prefix", point.prefix_tokens, 1, rng, vocab)
    first.arrival_time = engine.clock()
    engine.add_request(first)
    while engine.has_unfinished_requests():
        engine.step()
    return list(first.prompt_token_ids)


def decoder_output(point: Point, steps: int) -> int:
    """Output tokens each of a point's decoders is asked for: enough that none
    finishes before the point's ``steps`` timed and warm-up steps are over, however
    many steps their own prefills take (they are aborted afterwards)."""
    return steps + 8 + -(-point.decode_batch * point.context // PREFILL_BUDGET)


def measure_point(
    engine, executor, point: Point, repeats: int, warmup: int, vocab: int, seed: int
) -> dict:
    """Median cycle time of ``repeats`` steps of exactly this composition. A point
    with a cached prefix needs an engine with prefix caching on: its prefix is
    prefilled once (untimed), then every timed prefill repeats it in front of
    fresh tokens."""
    rng = random.Random(seed)
    sched, clock = engine.scheduler, engine.clock
    steps = warmup + repeats
    prefix = cache_prefix(engine, point, rng, vocab)
    out_len = decoder_output(point, steps)
    decodes = start_decoders(engine, point, out_len, rng, vocab, "d")
    timed_backend = executor.backend = TimedBackend(executor.backend, executor.device)
    rows = []
    for k in range(steps):
        if point.prefill_tokens:
            p = _request(f"p{k}", point.prefill_tokens, 1, rng, vocab, prefix)
            p.arrival_time = clock()
            engine.add_request(p)
        timed_backend.seconds = 0.0
        t0 = time.perf_counter()
        so = sched.schedule(clock())
        t1 = time.perf_counter()
        if point.prefill_tokens and so.num_prefill_tokens != point.prefill_tokens:
            raise RuntimeError(
                f"profiler point {point.label()}: scheduled {so.num_prefill_tokens} prefill "
                f"tokens, not {point.prefill_tokens} (a prefix not cached, or a token budget "
                "too small)"
            )
        result = executor.execute(so)
        sync(executor.device)
        t2 = time.perf_counter()
        sched.update_from_output(so, result, clock())
        t3 = time.perf_counter()
        if k >= warmup:
            rows.append(
                dict(
                    features=step_features(so),
                    total=t3 - t0,
                    schedule=t1 - t0,
                    execute=t2 - t1,
                    update=t3 - t2,
                    attention=timed_backend.seconds,
                    **executor.last_timings,
                )
            )
    executor.backend = timed_backend.backend
    for r in decodes:
        engine.abort_request(r.request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return summarize_point(point, rows)


def feature_columns(features: tuple) -> dict:
    """A step's :func:`step_features` as the profile table's columns."""
    return dict(zip(FEATURES, features, strict=True))


def summarize_point(point: Point, rows: list[dict]) -> dict:
    totals = [r["total"] for r in rows]
    mid = sorted(range(len(rows)), key=lambda i: totals[i])[len(rows) // 2]
    med = statistics.median

    def part(name: str) -> float:
        return med(r[name] for r in rows)

    forward = part("forward")
    return dict(
        kind="step",
        grid="point",
        decode_batch=point.decode_batch,
        context=point.context,
        prefill_tokens=point.prefill_tokens,
        prefix_tokens=point.prefix_tokens,
        **feature_columns(rows[mid]["features"]),
        latency_s=med(totals),
        latency_min_s=min(totals),
        latency_max_s=max(totals),
        repeats=len(rows),
        schedule_s=part("schedule"),
        prepare_s=part("prepare"),
        forward_s=forward,
        attention_s=part("attention"),
        linear_s=max(0.0, forward - part("attention")),
        sample_s=part("sample"),
        update_s=part("update"),
    )


# The profiler replay's prompt and output lengths.
REPLAY_LENGTHS = dict(
    prompt={"dist": "lognormal", "mean": 768, "cv": 0.8, "min": 16, "max": 1800},
    output={"dist": "lognormal", "mean": 192, "cv": 1.0, "min": 1, "max": 240},
)


def replay_kv_blocks(num_requests: int, block_size: int) -> int:
    """KV blocks that hold every request of the profiler's replay at once."""
    longest = REPLAY_LENGTHS["prompt"]["max"] + REPLAY_LENGTHS["output"]["max"]
    return num_requests * -(-longest // block_size) + 16


# The sparse replay's arrival rate (req/s): a request of the replay's lengths takes
# about 2.5 s alone on the 2-core CPU VM, so most run alone or in pairs.
SPARSE_RATE = 0.25


def measure_replay(
    engine,
    num_requests: int,
    vocab: int,
    idle_probe=None,
    rows: list[dict] | None = None,
    seed: int = 1234,
    rate: float = 2.5,
    name: str = "calibration",
    grid: str = "replay",
) -> list[dict]:
    """Every step of a short replay of the embedded synthetic trace (another seed
    than the default runs use): the batch mixes a real workload produces, which a
    grid alone does not cover. One row per step; with an ``idle_probe``, also
    one ``kind=idle_probe`` row per sample taken in the replay's idle gaps.
    Appended to ``rows`` where given, so that an interrupted or failed replay
    (re-raised here) leaves the steps it measured there.

    At the default ``rate`` the engine's batch fills, and only the last request
    decodes alone, at whatever context it has reached; the profiler also replays
    a few requests at :data:`SPARSE_RATE` (``name`` keeps their ids apart; their
    rows' ``grid`` is ``replay_sparse``, which the latency model fits as replay
    steps), whose one- and two-request decodes span every context, as a lightly
    loaded service (Azure conv at 70% of this engine's capacity) runs them."""
    from testbed.engine.replay import replay
    from testbed.workload import to_requests
    from traces.synthetic import synthetic_trace

    # Longer prompts than the default trace, so that contexts reach the model's
    # length; a different seed and shape from any workload it is evaluated on.
    trace = synthetic_trace(num_requests=num_requests, rate=rate, seed=seed, **REPLAY_LENGTHS)
    requests = to_requests(trace, with_tokens=True, vocab_size=vocab, seed=seed)
    for r in requests:
        r.request_id = f"{name}-{r.request_id}"
    rows = [] if rows is None else rows

    def record(res) -> None:
        so = res.scheduler_output
        if not so.requests:
            return
        rows.append(
            dict(
                kind="step",
                grid=grid,
                decode_batch=so.num_decode_tokens,
                context=0,
                prefill_tokens=so.num_prefill_tokens,
                **feature_columns(step_features(so)),
                latency_s=res.latency_s,
                repeats=1,
            )
        )

    result = replay(engine, requests, on_step=record, idle_probe=idle_probe)
    rows += idle_probe_rows((s for _, s in result.extra.get("idle_probe", [])), "replay_gaps")
    if result.error is not None:  # replay keeps what it measured and returns
        raise result.error
    if result.partial:
        raise KeyboardInterrupt(f"profiler replay: {result.stop_reason}")
    return rows


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

    On the 2-core VM it followed the runs' own step speed with a correlation of
    0.7 and to about 5% (experiments/results/fidelity_cpu1_idle_probe/): a record
    of the machine during a run, too coarse to correct a simulation to 5%."""

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
    conditions. On the 2-core VM they differed by -6% to +8% from pass to pass,
    with no consistent sign: the probe's own noise, which bounds how exactly it
    can say the machine's speed."""
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


def fit_args(args: EngineArgs, points: list[Point], repeats: int, warmup: int) -> None:
    """Engine options under which every point runs as measured: no prefix caching,
    a token budget for the largest decode batch plus a prefill, a context long
    enough for every point and a KV cache that holds any one point at once (no
    preemption while timing; on a GPU no more of the card than the largest point
    needs)."""
    steps = repeats + warmup
    bs = args.block_size

    def blocks(tokens: int) -> int:
        return -(-tokens // bs)

    prompt = max(p.prefix_tokens + p.prefill_tokens + 1 for p in points)
    longest = max(max(p.context + decoder_output(p, steps) for p in points), prompt)
    need = max(p.decode_batch * blocks(p.context + decoder_output(p, steps)) for p in points)
    need += blocks(prompt)  # a point's prefill (after its cached prefix) beside them
    args.enable_prefix_caching = False
    batch = max(p.decode_batch for p in points) + 1
    args.max_num_seqs = max(args.max_num_seqs, batch)
    args.max_num_batched_tokens = batch + PREFILL_BUDGET
    args.max_model_len = max(args.max_model_len or 0, longest + 16)
    args.num_kv_blocks = max(args.num_kv_blocks or 0, need + 16)


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
    :class:`~testbed.profiling.reference.ReferenceProbe` runs on those cores
    throughout, and the header's ``reference_probe_s`` is its median beside the
    busy engine, which runs with ``hardware.reference_cpus`` compare with theirs."""
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

    def write(filename: str, **extra: str) -> Path:
        """The table of what was measured, under ``<out_dir>/<hardware>/``."""
        path = Path(out_dir) / hardware / filename
        header = profile_header(args, replay_args, executor, hardware, name, repeats, warmup)
        header["grid"] = grid_note
        write_profile(path, {**header, **extra, **probe_headers(probes, rows)}, rows)
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
        grid_start = time.perf_counter()
        for point in points:
            if done and max_grid_s is not None and time.perf_counter() - grid_start > max_grid_s:
                break
            on = cached if point.prefix_tokens else (engine, executor)
            r = measure_point(*on, point, repeats, warmup, cfg.vocab_size, done)
            rows.append(r)
            rows += idle_probe_rows([idle_probe.after_pause()], "between_points")
            done += 1
            after = f" after {point.prefix_tokens} cached" if point.prefix_tokens else ""
            print(
                f"  [{done}/{len(points)}] decodes {point.decode_batch:>3} x ctx "
                f"{point.context:>5}, prefill {point.prefill_tokens:>5}{after}: "
                f"{r['latency_s'] * 1e3:8.2f} ms",
                flush=True,
            )
        del cached
        if done < len(points):
            skipped = ", ".join(p.label() for p in points[done:])
            grid_note = (
                f"{grid_name} ({done} of {len(points)} points; skipped at the {max_grid_s:g} s "
                f"limit, as decodes x context + prefill[@cached prefix]: {skipped})"
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
    return write(f"{name}.csv", **reference_header(reference, *replay))


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
    ran (:class:`~testbed.sim.latency.ProfileModel`). The idle tail and the
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


def cpu_name() -> str:
    """The host CPU's model name and widest vector extension (Linux; what
    ``platform`` knows elsewhere): two VMs of one name may differ 2-3x in a small
    model's step time (an AVX-512 one against an AVX2 AMD EPYC, 2026-12-02)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    first = info.split("\n\n", 1)[0]  # the first processor's block
    fields = dict(line.split(":", 1) for line in first.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    vector = next((f for f in ("avx512f", "avx2", "avx", "neon") if f in flags), "")
    name = fields.get("model name") or platform.machine()
    return name + (f", {vector.removesuffix('f').upper()}" if vector else "")


def machine_name(device: torch.device) -> str:
    """What a step's latency depends on beyond the engine's settings: the GPU's
    name for a CUDA device, else :func:`cpu_name`. A profile records it
    (``machine``) and so does every real run's ``metrics.json``, so that a run
    compared with a profile measured elsewhere says so
    (experiments/fidelity.py)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_name()


def profile_machine(header: dict) -> str | None:
    """The machine a profile was measured on: its header's ``machine``, else its
    ``cpu`` (tables of 2026-12-02), else None (tables before)."""
    return header.get("machine") or header.get("cpu")


def profile_header(
    args: EngineArgs,
    replay_args: EngineArgs,
    executor,
    hardware: str,
    name: str,
    repeats: int,
    warmup: int,
) -> dict:
    """Where, when and how a profile was measured."""
    device = executor.device
    machine = machine_name(device)
    return {
        "device": machine
        if device.type == "cuda"
        else f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"
        + (f", pinned to cores {sorted(args.cpus)}" if args.cpus is not None else ""),
        "machine": machine,
        "cpu": cpu_name(),
        "hardware": hardware,
        "model": name,
        "dtype": str(next(executor.model.parameters()).dtype).removeprefix("torch."),
        "tensor_parallel": 1,
        "block_size": args.block_size,
        "attention_backend": type(executor.backend).__name__
        if not hasattr(executor.backend, "__name__")
        else executor.backend.__name__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "repeats": repeats,
        "warmup": warmup,
        "sampling": ", ".join(f"{k}={v}" for k, v in SAMPLING.items()),
        "replay_engine": f"max_num_seqs={replay_args.max_num_seqs}, "
        f"max_num_batched_tokens={replay_args.max_num_batched_tokens}, "
        f"prefix_caching={replay_args.enable_prefix_caching}",
        "measured_by": "testbed.profiling (python run.py mode=profile)",
    }


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


def write_profile(path: Path, header: dict, table: pd.DataFrame | list[dict]) -> None:
    table = pd.DataFrame(table) if isinstance(table, list) else table
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for k, v in header.items():
            f.write(f"# {k}: {v}\n")
        table.to_csv(f, index=False, float_format="%.9g")


# Header probes that merge_profiles averages over the passes.
PROBE_KEYS = (
    "speed_probe_s",
    "idle_probe_s",
    "reference_probe_s",
    "reference_probe_grid_s",
    "reference_probe_replay_s",
)


def merge_profiles(paths: list[Path], out: Path) -> Path:
    """One profile from several passes of the profiler over the same engine,
    measured at different times: every pass's rows (column ``pass``), so the fit
    averages the machine's speed over the passes. On a machine whose speed
    wanders over minutes (a shared VM), passes spread over an experiment's
    window predict that window better than one pass taken at its start."""
    if not paths:
        raise ValueError("merge_profiles: no profiles to merge")
    headers = [read_profile_header(Path(p)) for p in paths]
    keys = ("hardware", "model", "dtype", "block_size", "attention_backend", "machine", "cpu")
    for key in keys:
        seen = {h[key] for h in headers if key in h}  # (cpu, machine: not in older tables)
        if len(seen) > 1:
            differ = sorted(map(str, seen))
            raise ValueError(f"merge_profiles: the passes differ in {key}: {differ}")
    tables = [pd.read_csv(p, comment="#").assign(**{"pass": i}) for i, p in enumerate(paths)]
    header = dict(headers[0])
    header.update(
        passes=len(paths),
        date=f"{headers[0].get('date', '?')} to {headers[-1].get('date', '?')}",
        pass_dates=", ".join(h.get("date", "?") for h in headers),
    )
    for key in PROBE_KEYS:  # the passes' mean
        probes = [float(h[key].split()[0]) for h in headers if key in h]
        if len(probes) == len(headers):
            listed = ", ".join(f"{p:.6g}" for p in probes)
            header[key] = f"{statistics.fmean(probes):.6g} (passes: {listed})"
        else:
            header.pop(key, None)  # a mean over some passes would not match the rows
    header["measured_by"] = f"{headers[0].get('measured_by', '?')}; {len(paths)} passes merged"
    write_profile(out, header, pd.concat(tables, ignore_index=True))
    return out
