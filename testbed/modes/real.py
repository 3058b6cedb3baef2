"""``mode=real``: replay the requests on the real engine, on the wall clock.

Beside the run, where configured: the idle probe (``mode.idle_probe``) samples
the machine's speed in the gaps between requests, and the reference probe
(``hardware.reference_cpus``) on other cores throughout. Afterwards the run's
steps are compared with the profile of its hardware and model, where one
exists (``speed_vs_profile``).

A closed-loop trace (``trace=concurrency``) is sent as its clients free
(:class:`~testbed.workload.ClosedLoop`): one engine's replay gets the first
requests and :class:`ClosedLoopEngine` sends each later one after the step
that ended its client's last; the cluster's parent sends them itself.
"""

from __future__ import annotations

import contextlib
import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch
from omegaconf import DictConfig

from testbed.build import (
    decider,
    draft_latency_model,
    engine_args,
    kv_faults,
    latency_model,
    max_concurrency,
    num_engines,
    pairing,
    router,
    run_model,
)
from testbed.core import EngineCore, Request, StepResult
from testbed.engine.cluster import replay_cluster, worker_args
from testbed.engine.device import machine_name
from testbed.engine.draft_model import DraftModelProposer
from testbed.engine.factory import build_engine, engine_model
from testbed.engine.replay import replay
from testbed.errors import InputError
from testbed.kernels import describe
from testbed.metrics import RunResult
from testbed.models import ModelSpec
from testbed.profiling.probes import IdleProbe
from testbed.profiling.reference_probe import ReferenceProbe, busy_median, sample_table
from testbed.sim.run_speed import speed_against, time_per_step
from testbed.threads import thread_settings
from testbed.workload import ClosedLoop


def run_real(
    cfg: DictConfig,
    requests: Sequence[Request],
    spec: ModelSpec,
    on_progress: Callable[[float, int], None] | None = None,
) -> tuple[RunResult, dict[str, Any]]:
    """Replay ``requests`` on the real engine; the run's records and the real
    engine's fields of ``metrics.json``."""
    args = engine_args(cfg)
    model = engine_model(run_model(cfg))
    clients = max_concurrency(cfg)
    closed = {"trace_max_concurrency": clients} if clients is not None else {}
    if cfg.cluster.num_replicas > 1 or cfg.cluster.num_prefill > 0:
        result, extra = run_cluster(cfg, args, model, requests, spec, on_progress)
        return result, {**closed, **extra}
    engine, executor, _ = build_engine(args, model=model)
    probe = IdleProbe(args, executor) if cfg.mode.idle_probe else None
    reference = None
    if cfg.hardware.reference_cpus:
        reference = ReferenceProbe(args, model, list(cfg.hardware.reference_cpus))
    driven, first, loop = engine, requests, None
    if clients is not None:
        loop = ClosedLoop(enumerate(requests), clients)
        first = [req for _, req in loop.send(0.0)]
        driven = ClosedLoopEngine(engine, loop)
    with reference or contextlib.nullcontext():
        result = replay(driven, first, on_progress, cfg.mode.max_wall_s, idle_probe=probe)
    if loop is not None:
        for _ in loop.unsent():  # a run stopped part-way: never sent, never arrived
            pass
        result.requests = list(requests)
    if reference is not None:  # its samples, each beside how much of the run's steps
        start = result.steps.column("start_s")
        busy = np.column_stack([start, start + result.steps.column("latency_s")])
        result.extra["reference_probe"] = sample_table(reference.samples, busy, engine.clock.origin)
    kv = engine.scheduler.kv
    extra = {
        **closed,
        "latency_model": "measured",
        "latency_model_source": f"real engine on {executor.device} (torch {torch.__version__})",
        "machine": machine_name(executor.device),
        "attention_backend": describe(executor.backend),
        "num_kv_blocks": kv.num_blocks,
        "prefix_cache_hit_rate": kv.stats.hit_rate,
        "tokens_computed": executor.num_computed_tokens,
        **idle_probe_metrics(result.extra.get("idle_probe")),
        **reference_metrics(result.extra.get("reference_probe")),
        **thread_settings(executor.threads),
        "partial": result.partial,
        "stop_reason": result.stop_reason,
    }
    if args.speculative_config is not None:
        stats = engine.scheduler.spec_stats
        extra.update(stats.metrics())
        # The proposer's time per step (the simulator's engine.speculative.propose_s_*).
        per_step, per_request = executor.proposer_time.fit()
        extra.update(spec_propose_s_per_step=per_step, spec_propose_s_per_request=per_request)
        result.extra["spec_acceptance"] = stats.table()  # spec_acceptance.csv
        if isinstance(executor.proposer, DraftModelProposer):
            extra.update(
                draft_speed_vs_profile(
                    cfg, executor.proposer.passes, executor.proposer_time.total_s
                )
            )
    # The proposer's time is the simulator's engine.speculative.propose_s_*, not the
    # profile's: it stays out of the machine's speed, step by step.
    timed = executor.proposer_time
    proposing = time_per_step(
        result.steps.column("start_s"),
        np.asarray(timed.starts) - engine.clock.origin,
        timed.durations,
    )
    extra.update(speed_vs_profile(cfg, spec, result.steps, exclude_s=proposing))
    return result, extra


class ClosedLoopEngine:
    """An engine as :func:`~testbed.engine.replay.replay` drives it, sending a closed
    loop's requests: replay adds the first ones, and after each step (or a request
    refused as it is added) this adds the next request of each client whose last
    one ended, stamped with that moment (its send time)."""

    def __init__(self, engine: EngineCore, loop: ClosedLoop) -> None:
        self.engine, self.loop = engine, loop
        self.clock = engine.clock

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def add_request(self, request: Request) -> bool:
        if self.engine.add_request(request):
            return True
        self._ended([request])
        return False

    def step(self) -> StepResult:
        result = self.engine.step()
        if result.finished:
            self._ended(result.finished)
        return result

    def _ended(self, requests: Sequence[Request]) -> None:
        now = self.clock()
        for req in requests:
            self.loop.ended(req, now)
        for _, req in self.loop.send(now):
            if not self.engine.add_request(req):
                self.loop.ended(req, now)  # refused at once: its client sends again now


def run_cluster(cfg, args, model, requests, spec, on_progress):
    """Engine processes behind the router (:mod:`testbed.engine.cluster`):
    ``cluster.num_replicas`` colocated, or ``num_prefill`` + ``num_decode``."""
    c = cfg.cluster
    size = num_engines(c)
    if cfg.mode.idle_probe or cfg.hardware.reference_cpus or args.speculative_config:
        raise InputError(
            f"cluster with {size} engine processes: the idle and reference probes and "
            "speculative decoding run with one engine only so far"
        )
    disagg = c.num_prefill > 0
    result = replay_cluster(
        args,
        requests,
        size,
        router(cfg),
        on_progress,
        cfg.mode.max_wall_s,
        model=model,
        num_prefill=c.num_prefill,
        decider=decider(cfg) if disagg else None,
        pairing=pairing(cfg) if disagg else None,
        faults=kv_faults(cfg) if disagg else None,
        kv_timeout_s=c.kv_transfer_timeout_s,
        kv_backend=c.kv_backend,
        max_concurrency=max_concurrency(cfg),
    )
    stats = result.extra.pop("replica_stats")
    hits = sum(s.get("prefix_hits", 0) for s in stats)
    queries = sum(s.get("prefix_queries", 0) for s in stats)
    extra = {
        "latency_model": "measured",
        "latency_model_source": f"{size} real engine processes",
        "num_kv_blocks": stats[0].get("num_kv_blocks") if stats else None,
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "tokens_computed": sum(s.get("tokens_computed", 0) for s in stats),
        "kv_blocks_held_at_end": sum(s.get("kv_blocks_held", 0) for s in stats),
        "replica_events": result.extra.pop("replica_events"),
        **thread_settings(threads=worker_args(args, size, 0).threads),  # each process's
        "partial": result.partial,
        "stop_reason": result.stop_reason,
    }
    extra.update(speed_vs_profile(cfg, spec, result.steps))
    return result, extra


def speed_vs_profile(cfg: DictConfig, spec: ModelSpec, steps, exclude_s=None) -> dict[str, Any]:
    """A real run's speed against the profile of its hardware and model
    (:func:`~testbed.sim.run_speed.speed_against`), and which profile; nothing
    where there is no profile or no busy step, and the error where the profile
    cannot be read. ``exclude_s``: per step, time the profile does not predict."""
    try:  # a diagnostic: an unreadable profile must not cost the run its files
        model = latency_model(cfg, spec)
        if model.kind != "profile":
            return {}
        speed = speed_against(model, steps, exclude_s=exclude_s)
    except (OSError, ValueError, KeyError) as err:
        print(f"WARNING: no speed against the profile: {err}")
        return {"speed_vs_profile_error": str(err)}
    return {**speed, "speed_profile": model.source} if speed else {}


def draft_speed_vs_profile(cfg: DictConfig, passes, seconds: float) -> dict[str, Any]:
    """A draft model's speed against its profile: the proposer's measured time over
    the draft's profile's prediction of the passes it ran (the simulator's
    ``engine.speculative.draft_latency_scale``, over the target's speed); nothing
    without a draft profile, the error where it cannot be read."""
    try:
        model = draft_latency_model(cfg)
        if model is None or model.kind != "profile" or not passes:
            return {}
        predicted = sum(model.predict(*f) + model.verification_s(s) for f, s in passes)
    except (OSError, ValueError, KeyError, InputError) as err:
        print(f"WARNING: no draft speed against its profile: {err}")
        return {"spec_draft_speed_vs_profile_error": str(err)}
    return {"spec_draft_speed_vs_profile": seconds / predicted, "spec_draft_profile": model.source}


def idle_probe_metrics(samples: list[tuple[float, float]] | None) -> dict[str, Any]:
    """metrics.json's summary of the idle probe's samples (none without the probe)."""
    if samples is None:
        return {}
    seconds = [s for _, s in samples]
    return {
        "idle_probe_s": statistics.median(seconds) if seconds else math.nan,
        "idle_probe_samples": len(seconds),
    }


def reference_metrics(table: pd.DataFrame | None) -> dict[str, Any]:
    """metrics.json's summary of the reference probe's samples (none without it):
    their median beside the busy engine."""
    if table is None:
        return {}
    median, n = busy_median(table)
    return {"reference_probe_s": median, "reference_probe_samples": n}
