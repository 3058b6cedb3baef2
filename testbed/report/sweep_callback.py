"""The Hydra callback of a multirun (``hydra.callbacks`` in ``conf/config.yaml``):
the sweep's summary after every job (``testbed/report/sweep.py``), and at its
end the dashboard (``testbed/report/dashboard.py``) and one W&B run for the
whole sweep."""

from __future__ import annotations

import atexit
import json
import os
import uuid
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.errors import CompactHydraException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from testbed.report.dashboard import write_dashboard
from testbed.report.rundir import SWEEP_ID
from testbed.report.sweep import FAILED, write_summary
from testbed.report.wandb_log import log_experiment


class SweepSummary(Callback):
    """Gives the sweep an id its jobs' folders record, rewrites its summary after
    every job (naming a failed job's error) and prints it when the multirun ends.

    Hydra's sweepers raise a failed job's error once its batch has run, and the
    multirun then ends without ``on_multirun_end`` (as it does when interrupted):
    the sweep's end (summary, dashboard, W&B) then runs as the process exits, for
    the jobs that finished."""

    def __init__(self) -> None:
        self.ended = True  # no multirun under way

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        os.environ[SWEEP_ID] = uuid.uuid4().hex  # inherited by launcher workers
        self.ended = False
        atexit.register(self.end_if_cut_short, config)

    def end_if_cut_short(self, config: DictConfig) -> None:
        if not self.ended:
            print(
                "\nthe sweep stopped early (a failed job, or an interrupt); what its finished "
                "jobs measured:"
            )
            self.on_multirun_end(config)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if config.hydra.mode != RunMode.MULTIRUN:
            return
        run_dir = Path(str(config.hydra.runtime.output_dir))
        sweep_dir = Path(str(config.hydra.sweep.dir))
        failed = job_return.status == JobStatus.FAILED
        if failed:
            error = job_return._return_value
            message = job_error(error)
            record = {"sweep": os.environ.get(SWEEP_ID), "error": message}
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / FAILED).write_text(json.dumps(record) + "\n")
        text = write_summary(sweep_dir, os.environ.get(SWEEP_ID))
        if failed and text is not None:  # Hydra stops before the multirun's end: say it now
            print(f"\nsweep {sweep_dir} so far ({sweep_dir / 'sweep_summary.csv'}):\n{text}")

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self.ended = True
        # Hydra resolves ${now:...} once per config (cached): the launcher's directory
        sweep_dir = Path(str(config.hydra.sweep.dir))
        text = write_summary(sweep_dir, os.environ.get(SWEEP_ID))
        if text is None:
            return
        print(f"\nsweep {sweep_dir} ({sweep_dir / 'sweep_summary.csv'}):\n{text}")
        dashboard = None
        try:
            dashboard = write_dashboard(sweep_dir)
            print(f"dashboard (opens offline): {dashboard}")
        except Exception as e:  # the runs are written; a figure that fails must not hide them
            print(f"WARNING: the sweep's dashboard could not be written: {type(e).__name__}: {e}")
        log_sweep(config, sweep_dir, dashboard)


def job_error(error: BaseException) -> str:
    """A failed job's reason: a bad input's message (the job's ``InputError``, which
    ``run.py`` raises as Hydra's compact kind), else the error's type and message."""
    if isinstance(error, CompactHydraException):
        return f"InputError: {error}"
    return f"{type(error).__name__}: {error}"


def log_sweep(config: DictConfig, sweep_dir: Path, dashboard: Path | None) -> None:
    """One W&B run for the whole sweep, in the runs' group: the combined table of
    its runs and the dashboard (nothing where W&B is disabled)."""
    wb = OmegaConf.to_container(config.logging.wandb, resolve=True)
    summary = sweep_dir / "sweep_summary.csv"
    if wb.get("mode") == "disabled" or not summary.exists():
        return
    import pandas as pd

    try:
        log_experiment(
            wb["mode"],
            Path(wb.get("dir") or sweep_dir),
            wb.get("group") or sweep_dir.name,
            {"sweep_dir": str(sweep_dir), "overrides": list(config.hydra.overrides.task)},
            {"runs": pd.read_csv(summary)},
            html={"dashboard": dashboard} if dashboard is not None else None,
            tags=[*(wb.get("tags") or []), "sweep"],
            name=f"sweep-{sweep_dir.name}",
            project=wb.get("project"),
        )
    except Exception as e:  # as above: the sweep's files stand without W&B
        print(f"WARNING: the sweep's W&B run could not be logged: {type(e).__name__}: {e}")
