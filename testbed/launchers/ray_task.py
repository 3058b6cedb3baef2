"""One Hydra job as a Ray task, on whichever worker of the cluster Ray picks.

The driver (``ray_launcher.py``) sends the job's config with what a job run by
Hydra's basic launcher would find in its own process: the driver's working
directory (the config's relative paths, ``hydra.sweep.dir`` among them, are read
from it) and the environment variables a job reads (the sweep's id, the
testbed's and W&B's settings). A worker on another node was started with its
own, so both are set here before Hydra runs the job.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import ray
from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, run_job, setup_globals
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from testbed.report.rundir import CLAIM, SWEEP_ID, read_claim

# Environment variables a job reads, by prefix: the sweep's id (SWEEP_ID), the
# testbed's paths (TESTBED_PROFILES_DIR, ...), W&B's and Hydra's settings.
FORWARDED = ("TESTBED_", "WANDB_", "HYDRA_")


class JobInterrupted(RuntimeError):
    """The job ended at an interrupt (its sweep cancelled), its worker left running."""


class WorkingDirMissing(RuntimeError):
    """The node lacks the sweep's working directory (not on shared storage)."""


def job_env() -> dict[str, str]:
    """The driver's variables a job reads (:data:`FORWARDED`)."""
    return {k: v for k, v in os.environ.items() if k.startswith(FORWARDED)}


def run_job_on_worker(
    hydra_context: HydraContext,
    sweep_config: DictConfig,
    task_function: TaskFunction,
    singleton_state: dict[Any, Any],
    env: dict[str, str],
    cwd: str,
) -> tuple[str, JobReturn]:
    """Run the job ``sweep_config`` as Hydra's launchers do (its folder, its saved
    config, the callbacks around it), in the driver's working directory ``cwd``
    and with its variables ``env``; a job's own error is in the returned
    :class:`JobReturn` (status FAILED), as with Hydra's basic launcher. Returned
    with where it ran (:func:`node`), which the driver logs."""
    os.environ.update(env)
    if not os.path.isdir(cwd):
        raise WorkingDirMissing(
            f"the sweep's working directory {cwd} does not exist on this node: the project "
            "checkout must be at the same path on every node (shared storage; "
            "docs/usage.md, 'Cluster sweeps')"
        )
    os.chdir(cwd)
    setup_globals()
    Singleton.set_state(singleton_state)
    HydraConfig.instance().set_config(sweep_config)
    without_bar(sweep_config)
    forget_earlier_attempt(job_dir(sweep_config))
    sigterm = signal.getsignal(signal.SIGTERM)  # run.py's job takes SIGTERM as an interrupt
    try:
        ret = run_job(
            hydra_context=hydra_context,
            task_function=task_function,
            config=sweep_config,
            job_dir_key="hydra.sweep.dir",
            job_subdir_key="hydra.sweep.subdir",
        )
        return node(), ret
    except SystemExit as e:  # an interrupted job (ray.cancel) wrote what it measured and exits
        raise JobInterrupted(f"the job was interrupted (exit status {e.code})") from None
    finally:  # Ray stops its idle workers with SIGTERM
        signal.signal(signal.SIGTERM, sigterm)


def without_bar(config: DictConfig) -> None:
    """Turn the job's progress bar into sparse lines (``progress=lines``): its output
    reaches the sweep's terminal through Ray's log streaming, a line per update,
    never redrawn in place. The driver shows the sweep's bar over jobs
    (``ray_launcher.sweep_bar``); a job's lines say it started and each tenth."""
    if OmegaConf.select(config, "progress", default=None) is True:
        with read_write(config), open_dict(config):
            config.progress = "lines"


def node() -> str:
    """The Ray node this worker is on: its id's first 8 hex digits (as Ray's logs
    abbreviate it; nodes on one machine share its address) and its address."""
    return f"{ray.get_runtime_context().get_node_id()[:8]} ({ray.util.get_node_ip_address()})"


def job_dir(config: DictConfig) -> Path:
    """The job's folder, as Hydra's ``run_job`` makes it: ``hydra.sweep.dir`` /
    ``hydra.sweep.subdir`` from the working directory (Hydra's config must be set
    for ``${hydra:...}``)."""
    sweep_dir = str(OmegaConf.select(config, "hydra.sweep.dir"))
    subdir = str(OmegaConf.select(config, "hydra.sweep.subdir"))
    return Path(os.path.abspath(Path(sweep_dir) / subdir))


def forget_earlier_attempt(run_dir: Path) -> None:
    """A retried job finds its folder claimed by its first attempt, whose worker
    died: the claim names this sweep, and in a sweep only this job writes to this
    folder, so the claim is that attempt's and is given up for this one."""
    sweep = os.environ.get(SWEEP_ID)
    if sweep is not None and read_claim(run_dir).get("sweep") == sweep:
        (run_dir / CLAIM).unlink(missing_ok=True)
