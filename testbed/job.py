"""One run from a resolved config, top down: build, run the mode, report.

``run.py`` (Hydra) calls :func:`run_from_config`; tests call it through Hydra's
compose API. The run's trace and requests come from the builders
(``testbed.build``), at the rate ``load`` sets where given
(``testbed.capacity``); the mode (``testbed.modes``) runs them and returns the
run's records; the report (``testbed.report``) writes the run directory, logs
to W&B and prints the summary. Every run writes its files even when
interrupted (marked partial).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from testbed.build import draft_model, load_requests, model_spec, num_engines, policy_name
from testbed.capacity import scaled_to_load
from testbed.config_schema import validate
from testbed.errors import InputError
from testbed.metrics.records import requests_frame
from testbed.metrics.summary import per_gpu, summarize
from testbed.modes.sim import simulate
from testbed.report.console import print_summary
from testbed.report.plots import timeline, write_plots
from testbed.report.progress import Progress
from testbed.report.rundir import (
    claim,
    release,
    release_ahead,
    write_idle_probe,
    write_metrics,
    write_reference_probe,
    write_spec_acceptance,
    write_tables,
)
from testbed.report.wandb_log import logged_config, wandb_settings
from testbed.report.wandb_process import WandbProcess

if TYPE_CHECKING:
    import pandas as pd

    from testbed.metrics import RunResult
    from testbed.models import ModelSpec


def run_from_config(cfg: DictConfig, run_dir: str | Path | None = None) -> dict[str, Any]:
    """Run ``cfg`` and write its run directory; returns ``metrics.json``'s contents."""
    try:
        validate(cfg)
    except InputError:
        release_ahead()  # nothing ran: the folder stays free for the corrected run
        raise
    if cfg.mode.name == "profile":
        from testbed.modes.profile import profile  # torch, only where a mode needs it

        return profile(cfg)
    wall_start = time.perf_counter()
    run_dir = Path(run_dir if run_dir is not None else hydra_run_dir())
    try:
        claim(run_dir)
    except OSError as e:
        raise InputError(f"run directory {run_dir}: cannot be written ({e})") from e
    try:
        return run_claimed(cfg, run_dir, wall_start)
    except InputError:  # refused for its input before it ran: nothing was written
        release(run_dir)
        raise


def run_claimed(cfg: DictConfig, run_dir: Path, wall_start: float) -> dict[str, Any]:
    """:func:`run_from_config` once ``run_dir`` is the run's."""
    spec, load, requests, fields = prepare(cfg)
    progress = Progress(len(requests), cfg.progress)
    sim = cfg.mode.name == "sim"

    def start_wandb() -> WandbProcess:
        return WandbProcess(
            wandb_settings(cfg, fields),
            run_dir,
            f"{cfg.mode.name}-{fields['policy']}-{cfg.trace.name}",
            logged_config(cfg, load),
        )

    # W&B starts in a process beside a simulation (report/wandb_process.py); beside a
    # real run it would take CPU from the engine whose step times the run measures,
    # so there it starts after.
    wandb = start_wandb() if sim else None
    try:
        try:
            if cfg.mode.name == "sim":
                result, extra = simulate(cfg, requests, spec, progress)
            elif cfg.mode.name == "real":
                from testbed.modes.real import run_real  # torch, only where a mode needs it

                result, extra = run_real(cfg, requests, spec, progress)
            elif cfg.mode.name == "vllm":
                from testbed.modes.vllm import run_vllm  # torch, only where a mode needs it

                result, extra = run_vllm(cfg, requests, spec, progress)
            else:
                raise ValueError(f"unknown mode {cfg.mode.name!r}: sim, real, vllm or profile")
        finally:
            progress.close()
        req_df = requests_frame(result.requests)
        metrics = {
            **fields,
            **summarize(result, req_df),
            **load,
            **extra,
        }
        metrics |= per_gpu(metrics)
    except BaseException as e:
        if wandb is not None:
            wandb.abandon(f"{type(e).__name__}: {e}")
        raise
    report(cfg, run_dir, result, req_df, metrics, wandb or start_wandb(), wall_start)
    if isinstance(result.error, KeyboardInterrupt):
        raise result.error  # written; the entry point exits with the signal's status
    if result.error is not None:
        raise RuntimeError(f"the run failed; what it measured is in {run_dir}") from result.error
    return metrics


def prepare(cfg: DictConfig) -> tuple[ModelSpec, dict[str, Any], list, dict[str, Any]]:
    """The run's model, its rate from ``load`` (where given), its requests and the
    fields that say what was run; a draft model that is missing or cannot draft for
    the run's model is refused first, in the same words in both modes."""
    draft_model(cfg)
    spec = model_spec(cfg.model)
    load = scaled_to_load(cfg, spec) if cfg.get("load") is not None else {}
    if load:
        print(
            f"capacity {load['capacity_req_s']:.4g} req/s in simulation (fcfs, "
            f"{load['capacity_from']}); replaying at {load['rate_req_s']:.4g} req/s "
            f"(load {cfg.load:g})"
        )
        if cfg.load > 1:
            print(
                f"WARNING: load={cfg.load:g} is above the engine's capacity: it cannot keep up "
                "with these arrivals, and latencies grow with the trace's length"
            )
    # A simulation makes its requests as it reaches them and keeps their records.
    trace, requests = load_requests(
        cfg, spec, rate=load.get("rate_req_s"), stream=cfg.mode.name == "sim"
    )
    return spec, load, requests, run_fields(cfg, spec.name, trace)


def hydra_run_dir() -> str:
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get().runtime.output_dir


def run_fields(cfg: DictConfig, model: str, trace: pd.DataFrame) -> dict[str, Any]:
    """``metrics.json``'s fields that say what was run."""
    return {
        "mode": cfg.mode.name,
        "policy": policy_name(cfg),
        "trace": trace_label(cfg),
        "model": model,
        "hardware": cfg.hardware.name,
        **cluster_shape(cfg.cluster, cfg.engine),
        "seed": cfg.seed,
        "trace_notes": "; ".join(trace.attrs.get("notes", [])),
    }


def trace_label(cfg: DictConfig) -> str:
    """The trace's config as chosen (``trace=azure_conv_tenants``) where Hydra made
    the choice, else its loader's name (``cfg.trace.name``, which variants share)."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return str(HydraConfig.get().runtime.choices.get("trace") or cfg.trace.name)
    return cfg.trace.name


def cluster_shape(cluster: DictConfig, engine: DictConfig) -> dict[str, Any]:
    """The cluster's replicas and router: a disaggregated one's prefill and decode
    replicas (``num_replicas`` their sum), its pairing and decider; the GPUs a
    replica spans (tensor x pipeline parallel) and all of them (``num_gpus``)."""
    disagg = cluster.num_prefill > 0
    tp, pp = engine.tensor_parallel_size, engine.pipeline_parallel_size
    shape: dict[str, Any] = {
        "num_replicas": num_engines(cluster),
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        "num_gpus": num_engines(cluster) * tp * pp,
        "router": cluster.router,
        "disaggregated": disagg,
    }
    if disagg:
        shape |= {
            "num_prefill": cluster.num_prefill,
            "num_decode": cluster.num_decode,
            "pairing": cluster.pairing,
            "decider": cluster.decider,
        }
    return shape


def report(
    cfg: DictConfig,
    run_dir: Path,
    result: RunResult,
    req_df: pd.DataFrame,
    metrics: dict[str, Any],
    wandb: WandbProcess,
    wall_start: float,
) -> None:
    """Print the summary, write the run directory and log to W&B; ``metrics``
    gains ``wall_s``, the run's own time. The summary comes first, so that a run
    whose folder cannot be written still shows what it measured; its files then
    go to a fallback folder, and the summary says where."""
    metrics["wall_s"] = time.perf_counter() - wall_start
    print_summary(metrics)
    series = timeline(result.steps)
    try:
        plots = write_run_dir(cfg, run_dir, result, req_df, metrics, series)
    except OSError as e:
        fallback = Path(tempfile.mkdtemp(prefix=f"{run_dir.name}-", dir=tempfile.gettempdir()))
        print(f"  WARNING: cannot write the run directory {run_dir} ({e}); writing to {fallback}")
        run_dir = fallback
        plots = write_run_dir(cfg, run_dir, result, req_df, metrics, series)
    print(f"  run directory: {run_dir}")
    wandb.log(run_dir, plots)


def write_run_dir(
    cfg: DictConfig,
    run_dir: Path,
    result: RunResult,
    req_df: pd.DataFrame,
    metrics: dict[str, Any],
    series: pd.DataFrame,
) -> list[Path]:
    """The run directory's files (docs/outputs.md); the plots written. ``series``:
    the binned step series (``timeline.csv``)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    write_tables(run_dir, req_df, result.steps, cfg.outputs.steps_format)
    series.to_csv(run_dir / "timeline.csv", index=False, float_format="%.6g")
    if result.extra.get("idle_probe") is not None:
        write_idle_probe(run_dir, result.extra["idle_probe"])
    if result.extra.get("reference_probe") is not None:
        write_reference_probe(run_dir, result.extra["reference_probe"])
    if result.extra.get("spec_acceptance") is not None:
        write_spec_acceptance(run_dir, result.extra["spec_acceptance"])
    title = f"{metrics['policy']} on {cfg.trace.name}"
    plots = write_plots(run_dir, req_df, series, title) if cfg.plots else []
    write_metrics(run_dir, metrics)
    return plots
