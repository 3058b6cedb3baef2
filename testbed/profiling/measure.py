"""Measuring one grid point: exactly that batch composition in a real engine,
each step's whole cycle timed and its parts (schedule, prepare, forward,
attention, sample, update) beside it."""

from __future__ import annotations

import random
import statistics
import time

import torch

from testbed.core import Request, SamplingParams
from testbed.profiling.grid import Point, decoder_output
from testbed.sim.latency import FEATURES, step_features


class TimedBackend:
    """An attention backend that adds up the time its kernels take: its own calls'
    and, on a CPU, what the fused decoder layer's attention adds to ``clock``."""

    def __init__(self, backend, device: torch.device) -> None:
        self.backend, self.device = backend, device
        self.clock = torch.zeros(1, dtype=torch.float64)
        self.seconds = 0.0

    @property
    def seconds(self) -> float:
        return self._seconds + float(self.clock)

    @seconds.setter
    def seconds(self, value: float) -> None:
        self._seconds = value
        self.clock.zero_()

    def _timed(self, name: str):
        fn = getattr(self.backend, name)

        def call(*args, **kwargs):
            sync(self.device)
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            sync(self.device)
            self._seconds += time.perf_counter() - t0
            return out

        return call

    def __getattr__(self, name: str):
        return self._timed(name)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
        for r in decodes:  # drafts to verify (random tokens: mostly rejected)
            r.spec_token_ids = [rng.randrange(vocab) for _ in range(point.drafts)] or ()
        for j, n in enumerate(point.prompt_lens()):
            p = _request(f"p{k}.{j}", n, 1, rng, vocab, prefix)
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
        drafts=point.drafts,
        prefills=point.prefills if point.prefill_tokens else 0,
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
