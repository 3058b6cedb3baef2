"""One run from a resolved config: load the trace, run it, write the run directory.

``run.py`` (Hydra) calls :func:`run_from_config`; tests call it through Hydra's
compose API. Every run writes its files even when interrupted (marked partial).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from policies import make_policy
from policies.routers import make_router
from testbed.capacity import scaled_to_load
from testbed.core import EngineCore, KVCacheManager, Scheduler, SchedulerConfig
from testbed.metrics.summary import requests_frame, summarize
from testbed.models import ModelSpec, num_kv_blocks
from testbed.report.rundir import write_idle_probe, write_metrics, write_plots, write_tables
from testbed.sim import HardwareSpec, SimExecutor, Simulation, make_latency_model
from testbed.sim.latency import speed_against
from testbed.sim.speed import SpeedTrace
from testbed.workload import to_requests
from traces import load_trace

if TYPE_CHECKING:
    import pandas as pd

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def model_spec(cfg: Mapping[str, Any]) -> ModelSpec:
    if cfg.get("hf_config"):
        return ModelSpec.from_hf_config(cfg["hf_config"], name=cfg["name"])
    if not cfg.get("path"):
        raise ValueError(f"model {cfg['name']!r} needs hf_config or path")
    path = Path(cfg["path"])
    path = path if path.is_absolute() else PROJECT_ROOT / path
    spec = ModelSpec.from_path(path)
    return ModelSpec(**{**{f: getattr(spec, f) for f in spec.__slots__}, "name": cfg["name"]})


def kv_blocks(
    engine: Mapping[str, Any],
    spec: ModelSpec,
    hw: HardwareSpec,
    dtype: str,
    kv_cache_bytes: float | None,
) -> int:
    """The engine's KV blocks: as configured, or derived from memory (both modes)."""
    if engine.get("num_kv_blocks"):
        return int(engine["num_kv_blocks"])
    return num_kv_blocks(
        spec,
        dtype,
        engine["block_size"],
        hw.memory_bytes,
        engine["gpu_memory_utilization"],
        hw.activation_reserve_bytes,
        engine.get("kv_cache_bytes") or kv_cache_bytes,
    )


def scheduler_config(engine: Mapping[str, Any], max_model_len: int) -> SchedulerConfig:
    return SchedulerConfig(
        max_num_batched_tokens=engine["max_num_batched_tokens"],
        max_num_seqs=engine["max_num_seqs"],
        max_model_len=max_model_len,
        enable_chunked_prefill=engine["enable_chunked_prefill"],
        long_prefill_token_threshold=engine["long_prefill_token_threshold"],
        num_lookahead_tokens=engine["num_speculative_tokens"],
    )


def trace_options(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in cfg.items() if k != "name" and v is not None}


def run_trace(cfg: DictConfig, rate: float | None = None) -> pd.DataFrame:
    """The run's trace, rescaled to ``rate`` req/s where given."""
    options = trace_options(OmegaConf.to_container(cfg.trace, resolve=True))
    if rate is not None:
        options["rate"] = rate
    return load_trace(cfg.trace.name, **options)


def load_requests(
    cfg: DictConfig, spec: ModelSpec, rate: float | None = None
) -> tuple[pd.DataFrame, list]:
    """The run's trace (:func:`run_trace`) and its requests, with token ids for
    the real engine."""
    trace = run_trace(cfg, rate)
    requests = to_requests(
        trace, with_tokens=cfg.mode.name == "real", vocab_size=spec.vocab_size, seed=cfg.seed
    )
    return trace, requests


class Progress:
    """A progress bar over finished requests, showing simulated time."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="req", mininterval=0.5, dynamic_ncols=True)
        self.done = 0
        self.every = max(1, min(64, total // 100))  # cheap on long runs, live on short ones

    def __call__(self, now: float, num_finished: int) -> None:
        if self.bar is not None and num_finished - self.done >= self.every:
            self.bar.update(num_finished - self.done)
            self.done = num_finished
            self.bar.set_postfix_str(f"t={now:,.1f}s", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def latency_model(cfg: DictConfig, spec: ModelSpec | None = None):
    """The simulator's latency model for this config: the profile of its hardware
    and model where one exists, else the roofline model."""
    spec = spec or model_spec(cfg.model)
    hw = HardwareSpec.from_config(cfg.hardware)
    profiles = Path(cfg.profiles_dir)
    return make_latency_model(
        spec, hw, cfg.model.dtype, profiles if profiles.is_absolute() else PROJECT_ROOT / profiles
    )


def speed_trace(cfg: DictConfig) -> SpeedTrace | None:
    """The run's ``mode.speed_trace`` (a CSV; relative to the working directory), if any."""
    path = cfg.mode.get("speed_trace")
    return SpeedTrace.from_csv(Path(path).resolve()) if path else None


def machine_speed(cfg: DictConfig, trace: SpeedTrace | None) -> SpeedTrace | None:
    """What the simulated steps are multiplied by: the speed trace times
    ``mode.latency_scale`` (a machine slower or faster than when profiled), the
    scale alone without a trace, or nothing."""
    scale = float(cfg.mode.get("latency_scale", 1.0))
    if trace is not None:
        return trace.scaled(scale) if scale != 1.0 else trace
    return SpeedTrace.constant(scale) if scale != 1.0 else None


def simulate(cfg: DictConfig, requests, spec: ModelSpec) -> tuple[Any, dict[str, Any]]:
    hw = HardwareSpec.from_config(cfg.hardware)
    engine = cfg.engine
    dtype = cfg.model.dtype
    latency = latency_model(cfg, spec)
    trace = speed_trace(cfg)
    speed = machine_speed(cfg, trace)
    blocks = kv_blocks(engine, spec, hw, dtype, cfg.hardware.get("kv_cache_bytes"))
    max_len = engine.max_model_len or spec.max_position_embeddings
    policy_cfg = OmegaConf.to_container(cfg.policy, resolve=True)
    engines: list[EngineCore] = []

    def make_engine(i: int, clock) -> EngineCore:
        kv = KVCacheManager(blocks, engine.block_size, engine.enable_prefix_caching)
        sched = Scheduler(scheduler_config(engine, max_len), kv, make_policy(policy_cfg))
        executor = SimExecutor(
            latency,
            engine.num_speculative_tokens,
            engine.spec_acceptance_rate,
            seed=cfg.seed + i,
            speed=speed,
            clock=clock,
        )
        engines.append(EngineCore(sched, executor, clock))
        return engines[-1]

    progress = Progress(len(requests), cfg.progress)
    sim = Simulation(
        requests,
        make_engine,
        latency,
        num_replicas=cfg.cluster.num_replicas,
        router=make_router(cfg.cluster.router),
        fast_forward=cfg.mode.fast_forward,
        on_progress=progress,
        max_sim_time_s=cfg.mode.max_sim_time_s,
    )
    try:
        result = sim.run()
    finally:
        progress.close()
    hits = sum(e.scheduler.kv.stats.hits for e in engines)
    queries = sum(e.scheduler.kv.stats.queries for e in engines)
    extra = {
        "latency_model": latency.kind,
        "latency_model_source": latency.source,
        "latency_scale": float(cfg.mode.get("latency_scale", 1.0)),
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
    return result, extra


def real_model(cfg: DictConfig):
    """(ModelConfig, weights folder or None, name) from the model config group."""
    from testbed.engine.config import ModelConfig

    m = cfg.model
    if m.get("hf_config"):
        hf = OmegaConf.to_container(m.hf_config, resolve=True)
        return ModelConfig.from_hf(hf, source=f"model={m.name}"), None, m.name
    folder = Path(m.path) if Path(m.path).is_absolute() else PROJECT_ROOT / m.path
    return ModelConfig.from_path(folder), folder, m.name


def engine_args(cfg: DictConfig):
    """The real engine's options from the engine, hardware, mode and policy groups."""
    from testbed.engine.llm import EngineArgs

    e = cfg.engine
    return EngineArgs(
        model=cfg.model.name,
        policy=OmegaConf.to_container(cfg.policy, resolve=True),
        max_num_seqs=e.max_num_seqs,
        max_num_batched_tokens=e.max_num_batched_tokens,
        block_size=e.block_size,
        enable_prefix_caching=e.enable_prefix_caching,
        enable_chunked_prefill=e.enable_chunked_prefill,
        long_prefill_token_threshold=e.long_prefill_token_threshold,
        max_model_len=e.max_model_len,
        num_kv_blocks=e.num_kv_blocks,
        kv_cache_bytes=e.kv_cache_bytes or cfg.hardware.get("kv_cache_bytes"),
        gpu_memory_utilization=e.gpu_memory_utilization,
        device=cfg.mode.get("device"),
        attention_backend=e.attention_backend,
        threads=cfg.hardware.get("threads"),
        cpus=cfg.hardware.get("cpus"),
        seed=cfg.seed,
    )


def run_real(cfg: DictConfig, requests) -> tuple[Any, dict[str, Any]]:
    """Replay on the real engine, on the wall clock."""
    import torch

    from testbed.engine.llm import build_engine
    from testbed.engine.replay import replay
    from testbed.profiling.profiler import machine_name

    args = engine_args(cfg)
    engine, executor, _ = build_engine(args, model=real_model(cfg))
    probe = None
    if cfg.mode.get("idle_probe"):
        from testbed.profiling.profiler import IdleProbe

        probe = IdleProbe(args, executor)
    reference = None
    if cfg.hardware.get("reference_cpus"):
        from testbed.profiling.reference import ReferenceProbe

        reference = ReferenceProbe(args, real_model(cfg), list(cfg.hardware.reference_cpus))
    progress = Progress(len(requests), cfg.progress)
    try:
        with reference or contextlib.nullcontext():
            result = replay(
                engine, requests, progress, cfg.mode.get("max_wall_s"), idle_probe=probe
            )
    finally:
        progress.close()
    if reference is not None:  # its samples, each beside how much of the run's steps
        import numpy as np

        from testbed.profiling.reference import sample_table

        start = result.steps.column("start_s")
        busy = np.column_stack([start, start + result.steps.column("latency_s")])
        result.extra["reference_probe"] = sample_table(reference.samples, busy, engine.clock.origin)
    kv = engine.scheduler.kv
    extra = {
        "latency_model": "measured",
        "latency_model_source": f"real engine on {executor.device} (torch {torch.__version__})",
        "machine": machine_name(executor.device),
        "num_kv_blocks": kv.num_blocks,
        "prefix_cache_hit_rate": kv.stats.hit_rate,
        "tokens_computed": executor.num_computed_tokens,
        **idle_probe_metrics(result.extra.get("idle_probe")),
        **reference_metrics(result.extra.get("reference_probe")),
        "partial": result.partial,
        "stop_reason": result.stop_reason,
    }
    return result, extra


def speed_vs_profile(cfg: DictConfig, spec: ModelSpec, steps) -> dict[str, Any]:
    """A real run's speed against the profile of its hardware and model
    (:func:`~testbed.sim.latency.speed_against`), and which profile; nothing
    where there is no profile or no busy step, and the error where the profile
    cannot be read."""
    try:  # a diagnostic: an unreadable profile must not cost the run its files
        model = latency_model(cfg, spec)
        if model.kind != "profile":
            return {}
        speed = speed_against(model, steps)
    except (OSError, ValueError, KeyError) as err:
        print(f"WARNING: no speed against the profile: {err}")
        return {"speed_vs_profile_error": str(err)}
    return {**speed, "speed_profile": model.source} if speed else {}


def idle_probe_metrics(samples: list[tuple[float, float]] | None) -> dict[str, Any]:
    """metrics.json's summary of the idle probe's samples (none without the probe)."""
    if samples is None:
        return {}
    seconds = [s for _, s in samples]
    return {
        "idle_probe_s": statistics.median(seconds) if seconds else math.nan,
        "idle_probe_samples": len(seconds),
    }


def reference_metrics(table) -> dict[str, Any]:
    """metrics.json's summary of the reference probe's samples (none without it):
    their median beside the busy engine (``testbed.profiling.reference``)."""
    if table is None:
        return {}
    from testbed.profiling.reference import busy_median

    median, n = busy_median(table)
    return {"reference_probe_s": median, "reference_probe_samples": n}


def profile_from_config(cfg: DictConfig) -> dict[str, Any]:
    """mode=profile: measure the real engine and write its profile table."""
    from testbed.profiling.profiler import report_profile, run_profile

    profiles = Path(cfg.profiles_dir)
    profiles = profiles if profiles.is_absolute() else PROJECT_ROOT / profiles
    print(f"profiling {cfg.model.name} on {cfg.hardware.name}: grid {cfg.mode.grid}")
    path = run_profile(
        engine_args(cfg),
        cfg.mode.grid,
        cfg.mode.repeats,
        cfg.mode.warmup,
        profiles,
        cfg.hardware.name,
        cfg.model.name,
        model=real_model(cfg),
        replay_requests=cfg.mode.replay_requests,
        sparse_requests=cfg.mode.get("replay_sparse_requests", 0),
        max_grid_s=cfg.mode.get("max_grid_s"),
        reference_cpus=cfg.hardware.get("reference_cpus"),
    )
    return {"mode": "profile", "profile": str(path), "fit_rel_error": report_profile(path)}


def run_from_config(cfg: DictConfig, run_dir: str | Path | None = None) -> dict[str, Any]:
    """Run ``cfg`` and write its run directory; returns ``metrics.json``'s contents."""
    if cfg.mode.name == "profile":
        return profile_from_config(cfg)
    wall_start = time.perf_counter()
    if run_dir is None:
        from hydra.core.hydra_config import HydraConfig

        run_dir = HydraConfig.get().runtime.output_dir
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    mode = cfg.mode.name
    spec = model_spec(cfg.model)
    load = scaled_to_load(cfg, spec) if cfg.get("load") is not None else {}
    if load:
        print(
            f"capacity {load['capacity_req_s']:.4g} req/s in simulation (fcfs, "
            f"{load['capacity_from']}); replaying at {load['rate_req_s']:.4g} req/s "
            f"(load {cfg.load:g})"
        )
    trace, requests = load_requests(cfg, spec, rate=load.get("rate_req_s"))
    if mode == "sim":
        result, extra = simulate(cfg, requests, spec)
    elif mode == "real":
        result, extra = run_real(cfg, requests)
        extra.update(speed_vs_profile(cfg, spec, result.steps))
    else:
        raise ValueError(f"unknown mode {mode!r}: sim or real")
    req_df = requests_frame(result.requests)
    metrics: dict[str, Any] = {
        "mode": mode,
        "policy": cfg.policy.name,
        "trace": cfg.trace.name,
        "model": spec.name,
        "hardware": cfg.hardware.name,
        "seed": cfg.seed,
        "trace_notes": "; ".join(trace.attrs.get("notes", [])),
    }
    metrics.update(summarize(result.requests, result.steps, req_df))
    metrics.update(load)
    metrics.update(extra)
    write_tables(run_dir, req_df, result.steps)
    if result.extra.get("idle_probe") is not None:
        write_idle_probe(run_dir, result.extra["idle_probe"])
    if result.extra.get("reference_probe") is not None:
        result.extra["reference_probe"].to_csv(
            Path(run_dir) / "reference_probe.csv", index=False, float_format="%.6g"
        )
    plots = (
        write_plots(run_dir, req_df, result.steps, f"{cfg.policy.name} on {cfg.trace.name}")
        if cfg.plots
        else []
    )
    metrics["wall_s"] = time.perf_counter() - wall_start
    write_metrics(run_dir, metrics)
    from testbed.report.wandb_log import log_run

    log_run(
        wandb_settings(cfg),
        run_dir,
        f"{mode}-{cfg.policy.name}-{cfg.trace.name}",
        logged_config(cfg, load),
        metrics,
        req_df,
        result.steps,
        plots,
    )
    print_summary(metrics, run_dir)
    if result.error is not None:
        raise RuntimeError(f"the run failed; what it measured is in {run_dir}") from result.error
    return metrics


def logged_config(cfg: DictConfig, load: Mapping[str, Any]) -> dict[str, Any]:
    """The resolved config as W&B records it: with ``load``, the rate it set."""
    config = OmegaConf.to_container(cfg, resolve=True)
    if load:
        config["trace"]["rate"] = load["rate_req_s"]
    return config


def wandb_settings(cfg: DictConfig) -> dict[str, Any]:
    """The logging config, with a sweep's defaults: its runs share a group (the sweep
    folder) and are tagged with mode, policy and trace, so W&B compares them."""
    wb = OmegaConf.to_container(cfg.logging.wandb, resolve=True)
    wb["tags"] = list(wb.get("tags") or []) + [cfg.mode.name, cfg.policy.name, cfg.trace.name]
    if wb.get("group") is None:
        try:
            from hydra.core.hydra_config import HydraConfig
            from hydra.types import RunMode

            hc = HydraConfig.get()
            if hc.mode == RunMode.MULTIRUN:
                wb["group"] = Path(hc.sweep.dir).name
        except ValueError:  # not under Hydra (a test, a script)
            pass
    return wb


# |speed_vs_profile - 1| above which a real run's summary says the machine moved
SPEED_NOTE = 0.10


def print_summary(m: Mapping[str, Any], run_dir: Path) -> None:
    rows = [
        ("requests (finished / rejected)", f"{m['num_finished']} / {m['num_rejected']}"),
        (
            "throughput (req/s, out tok/s)",
            f"{m['throughput_req_s']:.3f}, {m['throughput_output_tok_s']:.1f}",
        ),
        ("TTFT mean / p99 (s)", f"{m['ttft_s_mean']:.4f} / {m['ttft_s_p99']:.4f}"),
        ("TPOT mean / p99 (s)", f"{m['tpot_s_mean']:.4f} / {m['tpot_s_p99']:.4f}"),
        ("E2E mean / p99 (s)", f"{m['e2e_s_mean']:.3f} / {m['e2e_s_p99']:.3f}"),
        (
            "preemptions, prefix hit rate",
            f"{m['num_preemptions']}, {m['prefix_cache_hit_rate']:.3f}",
        ),
        ("KV usage mean / max", f"{m['kv_usage_mean']:.3f} / {m['kv_usage_max']:.3f}"),
        ("latency model", str(m.get("latency_model"))),
        ("wall time (s)", f"{m['wall_s']:.2f}"),
    ]
    # The simulated machine, where it is not the profiled one.
    slower = [f"x {m['latency_scale']:.4g}"] if m.get("latency_scale", 1.0) != 1.0 else []
    slower += [m["speed_trace"]] if m.get("speed_trace") else []
    if slower:
        rows.insert(-1, ("step latencies", ", ".join(slower)))
    speed = m.get("speed_vs_profile")
    if speed is not None:
        low, high = m["speed_vs_profile_min"], m["speed_vs_profile_max"]
        spread = f" ({low:.3f}-{high:.3f} minute by minute)" if high > low else ""
        rows.insert(-1, ("speed vs profile", f"{speed:.3f}x its step time{spread}"))
    head = f"{m['mode']} | {m['policy']} | {m['trace']} | {m['model']} on {m['hardware']}"
    if m.get("partial"):
        head += f" | PARTIAL ({m.get('stop_reason')})"
    width = max(len(k) for k, _ in rows)
    print(head)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    if m.get("overloaded"):
        print(
            f"  OVERLOADED: {m['waiting_at_last_arrival']} of "
            f"{m['num_requests'] - m['num_rejected']} requests were still waiting when the last "
            f"one arrived (offered {m['offered_req_s']:.3g} req/s, served "
            f"{m['throughput_req_s']:.3g}): latencies measure the backlog. Lower the load "
            "(load=0.7: 70% of this engine's capacity; or trace.rate) or add replicas."
        )
    if speed is not None and abs(speed - 1) > SPEED_NOTE:
        print(
            f"  NOTE: this run's steps took {speed:.2f}x the time its hardware's profile "
            f"predicts ({m['speed_profile']}): the machine ran "
            f"{'slower' if speed > 1 else 'faster'} than when it was profiled (a shared "
            "machine's speed moves) or the profile does not fit this engine config. A "
            f"simulation at mode.latency_scale={speed:.3g} runs at this speed; real runs "
            "compared with each other differ by their machines' speeds as well (see "
            "speed_vs_profile in each metrics.json)."
        )
    print(f"  run directory: {run_dir}")
