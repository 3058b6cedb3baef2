"""W&B logging: offline by default (no account; ``wandb sync`` later), online on request.

Each run logs its resolved config, the summary metrics, the step time series
(binned, one table), the plots and the per-request table (a parquet file
artifact), from its written run directory, in a process of its own
(``testbed/report/wandb_process.py``). Runs of a sweep share a group and tags,
so a W&B workspace compares policies side by side.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd
from omegaconf import DictConfig, OmegaConf

PROJECT = "llm-sched-testbed"


def start(mode: str, directory: Path, **init: Any):
    """A W&B run writing under ``directory``; None when ``mode`` is ``disabled``."""
    if mode == "disabled":
        return None
    os.environ.setdefault("WANDB_SILENT", "true")
    import wandb

    directory.mkdir(parents=True, exist_ok=True)
    # console="off": the run folder has the console's log (Hydra's run.log);
    # x_disable_stats: no system-metrics process (a simulation lasts seconds)
    settings = wandb.Settings(console="off", x_disable_stats=True)
    return wandb.init(
        mode=mode, dir=str(directory), reinit="finish_previous", settings=settings, **init
    )


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


def log_requests(run, requests: pd.DataFrame, folder: Path, table_rows: int = 0) -> str:
    """The per-request table in W&B: always whole, as ``requests.parquet``, a file
    artifact (a W&B table costs about a third of a millisecond a row: a day's
    requests would take longer than simulating them), and also as a W&B table
    where it has at most ``table_rows`` rows (0: never). Says which in the run's
    summary (``requests_logged_as``) and returns it."""
    import wandb

    path = folder / "requests.parquet"
    requests.to_parquet(path, index=False)
    artifact = wandb.Artifact(f"requests-{run.id}", type="run-table")
    artifact.add_file(str(path), name="requests.parquet", policy="immutable")
    run.log_artifact(artifact)
    how = f"file artifact requests.parquet ({len(requests)} rows)"
    if 0 < len(requests) <= min(table_rows, TABLE_ROWS):
        run.log({"requests": wandb.Table(dataframe=requests)})
        how += " and table"
    run.summary["requests_logged_as"] = how
    return how


def log_run(run, run_dir: Path, plots: list[Path], table_rows: int = 0) -> str:
    """Log a written run directory to ``run`` in one ``log`` call (each call
    costs W&B a record): the binned step series (``timeline.csv``) as one table
    with a line chart per series, the plots, the request table
    (:func:`log_requests`, from ``requests.csv``) and ``metrics.json`` as the
    summary; returns the W&B run folder."""
    import wandb

    series = pd.read_csv(run_dir / "timeline.csv")
    table = wandb.Table(dataframe=series)
    logged: dict[str, Any] = {"steps": table}
    for name in series.columns.drop("time_s"):
        logged[f"steps/{name}"] = wandb.plot.line(
            table, "time_s", name, title=f"{name} over time (binned)"
        )
    logged |= {p.stem: wandb.Image(str(p)) for p in plots}
    run.log(logged)
    log_requests(run, pd.read_csv(run_dir / "requests.csv"), Path(run.dir), table_rows)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    run.summary.update({k: v for k, v in metrics.items() if v is not None})
    return run.dir


def log_experiment(
    mode: str,
    directory: Path,
    group: str,
    config: dict[str, Any],
    tables: Mapping[str, pd.DataFrame],
    images: Mapping[str, Path] | None = None,
    tags: list[str] | None = None,
    html: Mapping[str, Path] | None = None,
    name: str | None = None,
    project: str | None = None,
) -> None:
    """Log an experiment's (or a sweep's) result tables (empty ones left out),
    images and HTML pages as one W&B run of ``group``; nothing when ``mode`` is
    ``disabled``."""
    run = start(
        mode, directory, project=project or PROJECT, group=group, config=config,
        tags=tags or [group], name=name, job_type="experiment",
    )  # fmt: skip
    if run is None:
        return
    import wandb

    try:
        logged = {k: wandb.Table(dataframe=t) for k, t in tables.items() if not t.empty}
        logged |= {k: wandb.Image(str(path)) for k, path in (images or {}).items()}
        logged |= {k: wandb.Html(str(path)) for k, path in (html or {}).items()}
        run.log(logged)
    finally:
        run.finish()
