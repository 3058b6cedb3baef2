"""``mode=sim``: replay the requests in the discrete-event simulator."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from omegaconf import DictConfig

from policies import make_policy
from testbed.build import (
    acceptance_model,
    decider,
    draft_latency_model,
    hardware_spec,
    kv_blocks,
    kv_faults,
    latency_model,
    link_spec,
    machine_speed,
    max_concurrency,
    pairing,
    policy_config,
    router,
    scheduler_config,
    speed_trace,
)
from testbed.core import EngineCore, Request
from testbed.core.kv_connector import PDConnector
from testbed.core.spec_stats import SpecDecodingStats
from testbed.metrics import RunResult
from testbed.models import ModelSpec
from testbed.sim.disagg import DisaggSimulation
from testbed.sim.executor import SimExecutor
from testbed.sim.simulator import Simulation


def simulate(
    cfg: DictConfig,
    requests: Sequence[Request],
    spec: ModelSpec,
    on_progress: Callable[[float, int], None] | None = None,
) -> tuple[RunResult, dict[str, Any]]:
    """Simulate ``requests`` on ``cfg``'s cluster of engines; the run's records
    and the simulation's fields of ``metrics.json``."""
    engine = cfg.engine
    latency = latency_model(cfg, spec)
    trace = speed_trace(cfg)
    speed = machine_speed(cfg, trace)
    blocks = kv_blocks(
        engine, spec, hardware_spec(cfg), cfg.model.dtype, cfg.hardware.kv_cache_bytes
    )
    max_len = engine.max_model_len or spec.max_position_embeddings
    policy = policy_config(cfg)
    acceptance = acceptance_model(cfg, spec)
    draft = draft_latency_model(cfg) if acceptance is not None else None
    engines: list[EngineCore] = []

    cluster = cfg.cluster
    disagg = cluster.num_prefill > 0

    limits = scheduler_config(engine, max_len)

    def make_engine(i: int, clock) -> EngineCore:
        connector = None
        if disagg:  # replicas 0..P-1 prefill, the rest decode
            connector = PDConnector("producer" if i < cluster.num_prefill else "consumer", i)
        executor = SimExecutor(
            latency,
            acceptance,
            seed=cfg.seed + i,
            propose_s=(
                engine.speculative.propose_s_per_step,
                engine.speculative.propose_s_per_request,
            ),
            draft_latency=draft,
            draft_latency_scale=engine.speculative.draft_latency_scale,
            speed=speed,
            clock=clock,
        )
        engines.append(
            EngineCore.build(
                executor,
                make_policy(policy),
                blocks,
                engine.block_size,
                engine.enable_prefix_caching,
                clock,
                config=limits,
                connector=connector,
            )
        )
        return engines[-1]

    common = dict(
        router=router(cfg),
        fast_forward=cfg.mode.fast_forward,
        on_progress=on_progress,
        max_sim_time_s=cfg.mode.max_sim_time_s,
        max_concurrency=max_concurrency(cfg),
    )
    if disagg:
        sim = DisaggSimulation(
            requests,
            make_engine,
            latency,
            cluster.num_prefill,
            cluster.num_decode,
            link_spec(cfg),
            spec.kv_bytes_per_token(cfg.model.dtype),
            decider=decider(cfg),
            pairing=pairing(cfg),
            faults=kv_faults(cfg),
            timeout_s=cluster.kv_transfer_timeout_s,
            **common,
        )
    else:
        sim = Simulation(
            requests,
            make_engine,
            latency,
            num_replicas=cluster.num_replicas,
            **common,
        )
    result = sim.run()
    hits = sum(e.scheduler.prefix_cache_stats.hits for e in engines)
    queries = sum(e.scheduler.prefix_cache_stats.queries for e in engines)
    extra = {
        "latency_model": latency.kind,
        "latency_model_source": latency.source,
        # which source priced each part of a step (the GPU operator model's parts)
        **{f"latency_source_{part}": src for part, src in getattr(latency, "sources", {}).items()},
        "latency_scale": cfg.mode.latency_scale,
        "speed_trace": trace.describe() if trace is not None else None,
        "num_kv_blocks": blocks,
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "sim_wall_s": result.wall_s,
        "sim_requests_per_wall_s": len(requests) / result.wall_s if result.wall_s else math.nan,
        "num_jumps": result.num_jumps,
        "num_jumped_steps": result.num_jumped_steps,
        "partial": result.partial,
        "stop_reason": result.stop_reason,
    }
    if max_concurrency(cfg) is not None:
        extra["trace_max_concurrency"] = max_concurrency(cfg)
    if disagg:
        extra.update(sim.disagg_metrics(result.duration_s))
    if acceptance is not None:
        stats = SpecDecodingStats.merged(e.scheduler.spec_stats for e in engines)
        extra.update(spec_acceptance_model=acceptance.source, **stats.metrics())
        if acceptance.header:  # how the table was measured
            extra["spec_acceptance_table_header"] = acceptance.header
        if draft is not None:
            extra["spec_draft_latency_model"] = draft.source
        result.extra["spec_acceptance"] = stats.table()  # spec_acceptance.csv
    return result, extra
