"""W&B logging: offline by default (no account; ``wandb sync`` later), online on request.

Each run logs its resolved config, the summary metrics, the step time series
(binned), the per-request table and the plots. Runs of a sweep share a group
and tags, so a W&B workspace compares policies side by side.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd
from omegaconf import DictConfig, OmegaConf

from testbed.metrics.steplog import StepLog
from testbed.report.plots import binned

PROJECT = "llm-sched-testbed"


def _start(mode: str, directory: Path, **init: Any):
    """A W&B run writing under ``directory``; None when ``mode`` is ``disabled``."""
    if mode == "disabled":
        return None
    os.environ.setdefault("WANDB_SILENT", "true")
    import wandb

    directory.mkdir(parents=True, exist_ok=True)
    return wandb.init(mode=mode, dir=str(directory), reinit="finish_previous", **init)


def logged_config(cfg: DictConfig, load: Mapping[str, Any]) -> dict[str, Any]:
    """The resolved config as W&B records it: with ``load``, the rate it set."""
    config = OmegaConf.to_container(cfg, resolve=True)
    if load:
        config["trace"]["rate"] = load["rate_req_s"]
    return config


def wandb_settings(cfg: DictConfig, metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The logging config, with a sweep's defaults: its runs share a group (the sweep
    folder) and are tagged with mode, policy and trace (as ``metrics`` names them),
    so W&B compares them."""
    wb = OmegaConf.to_container(cfg.logging.wandb, resolve=True)
    wb["tags"] = list(wb.get("tags") or []) + [metrics[k] for k in ("mode", "policy", "trace")]
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


# Rows a W&B table holds (it cuts longer ones).
TABLE_ROWS = 200_000


def log_requests(run, requests: pd.DataFrame, csv: Path, table_rows: int = TABLE_ROWS) -> str:
    """The per-request table in W&B: a W&B table up to ``table_rows`` rows (a
    table costs W&B about a third of a millisecond per row; it holds at most
    :data:`TABLE_ROWS`), else the run's ``requests.csv`` whole, as a file
    artifact (never cut, and a file copy). Says which in the run's summary
    (``requests_logged_as``) and returns it."""
    import wandb

    rows = min(table_rows, TABLE_ROWS)
    if len(requests) <= rows or not csv.exists():
        run.log({"requests": wandb.Table(dataframe=requests.head(TABLE_ROWS))})
        how = "table" if len(requests) <= TABLE_ROWS else f"table of the first {TABLE_ROWS} rows"
    else:
        artifact = wandb.Artifact(f"requests-{run.id}", type="run-table")
        artifact.add_file(str(csv), name="requests.csv")
        run.log_artifact(artifact)
        how = f"file artifact requests.csv ({len(requests)} rows; tables up to {rows} rows)"
    run.summary["requests_logged_as"] = how
    if how.startswith("table of"):
        print(f"  W&B: the request table is logged as a {how}")
    return how


def log_run(
    wandb_cfg: Mapping[str, Any],
    run_dir: Path,
    name: str,
    config: dict[str, Any],
    metrics: dict[str, Any],
    requests: pd.DataFrame,
    steps: StepLog,
    plots: list[Path],
) -> str | None:
    """Log one run; returns the W&B run folder (None when disabled)."""
    run = _start(
        wandb_cfg.get("mode", "offline"),
        Path(wandb_cfg.get("dir") or run_dir),
        project=wandb_cfg.get("project", PROJECT),
        entity=wandb_cfg.get("entity"),
        group=wandb_cfg.get("group"),
        tags=list(wandb_cfg.get("tags") or []),
        name=name,
        config=config,
    )
    if run is None:
        return None
    import wandb

    try:
        times, series = binned(
            steps, ("num_waiting", "num_reqs", "kv_usage", "latency_s"), bins=1000
        )
        for i, ts in enumerate(times):
            run.log({"time_s": float(ts), **{f"steps/{k}": float(v[i]) for k, v in series.items()}})
        rows = wandb_cfg.get("table_rows", TABLE_ROWS)
        log_requests(run, requests, run_dir / "requests.csv", rows)
        run.log({p.stem: wandb.Image(str(p)) for p in plots})
        run.summary.update({k: v for k, v in metrics.items() if v is not None})
        return run.dir
    finally:
        run.finish()


def log_experiment(
    mode: str,
    directory: Path,
    group: str,
    config: dict[str, Any],
    tables: Mapping[str, pd.DataFrame],
    images: Mapping[str, Path] | None = None,
    tags: list[str] | None = None,
) -> None:
    """Log an experiment's result tables (empty ones left out) and images as one
    W&B run of ``group``; nothing when ``mode`` is ``disabled``."""
    run = _start(mode, directory, project=PROJECT, group=group, config=config, tags=tags or [group])
    if run is None:
        return
    import wandb

    try:
        logged = {k: wandb.Table(dataframe=t) for k, t in tables.items() if not t.empty}
        logged |= {k: wandb.Image(str(path)) for k, path in (images or {}).items()}
        run.log(logged)
    finally:
        run.finish()
