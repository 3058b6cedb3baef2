"""``hydra/launcher=ray``: a multirun's jobs as Ray tasks on a Ray cluster.

The published plugin (``hydra-ray-launcher``) submits each job as a Ray task and
waits for them in order. This launcher keeps its config (``ray.init``: the
arguments of ``ray.init``, whose ``address`` null joins the cluster that
``ray start`` began on this machine or else starts one for the sweep;
``ray.remote``: the tasks' options) and adds what a sweep of the testbed needs:

* each job runs in the driver's working directory with the variables a job
  reads (``ray_task.py``), so that its folder is where ``hydra.sweep.dir`` says;
* the jobs are awaited as they end. Ctrl-C or SIGTERM cancels the tasks still
  out (``ray.cancel``: a running job is interrupted and writes what it measured,
  as in a local sweep) and the process ends with the signal's status, the sweep's
  summary of what finished written as it exits (``report/sweep_callback.py``);
* a job whose worker dies (its process killed, its node lost) runs once more
  (``ray.remote.max_retries``), then is a FAILED job that names the death, recorded
  by the sweep's callbacks here as a job that raises is recorded on its worker;
* the sweep's log says which node ran each job (``#2 ran on node 1a2b3c4d (addr)``);
* where jobs would show a progress bar (``progress=true``) and the sweep's stderr
  is a terminal, the driver shows one bar over the sweep's jobs: a job's own bar
  would reach it through Ray's log streaming a line per update, so the jobs print
  a line at each tenth of their requests instead (``progress=lines``,
  ``ray_task.without_bar``).
"""

from __future__ import annotations

import copy
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, setup_globals
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from testbed.launchers.ray_task import job_dir, job_env, run_job_on_worker
from testbed.signals import Terminated, exit_status, sigterm_as_interrupt, sigterm_received

# Every job's lines shown, as in a local sweep: Ray's driver would fold the lines of
# different jobs that differ only in their numbers (it reads this when imported).
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
try:
    import ray
    from hydra_plugins.hydra_ray_launcher.ray_launcher import (
        RayLauncher as PluginRayLauncher,
    )
except ImportError as e:  # the shim (hydra_plugins/testbed_launchers) shows it in one line
    raise ImportError(
        f"hydra/launcher=ray needs Ray and its Hydra plugin ({e}): pip install -e '.[ray]'"
    ) from e

log = logging.getLogger(__name__)

# The tasks' options where ``ray.remote`` does not set them: a job whose worker dies
# runs once more; a job that raises has failed (it would raise again).
TASK_DEFAULTS = {"max_retries": 1, "retry_exceptions": False}
# How long an interrupted sweep waits for its running jobs to write what they measured
# (a second Ctrl-C stops them at once).
GRACE_S = 60.0
POLL_S = 0.5  # how often the driver looks for an interrupt while jobs run


class WorkerDied(RuntimeError):
    """The worker running a job died (its process killed, its node lost) on every try."""


@dataclass
class Job:
    """A submitted job: its number, overrides, config and Ray task."""

    num: int
    overrides: list[str]
    config: DictConfig
    ref: Any


class RayLauncher(PluginRayLauncher):
    """The plugin's launcher (its ``ray`` config: ``init``, ``remote``), launching
    jobs as the module says."""

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        """Run the jobs ``job_overrides`` (numbered from ``initial_job_idx``) as Ray
        tasks; their returns in that order, each job that failed as FAILED."""
        assert self.config is not None and self.hydra_context is not None
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        connect(self.ray_cfg.init)
        where = f"{cluster_resources()}, in {sweep_dir}"
        log.info(f"Ray launcher: {len(job_overrides)} jobs on {where}")
        remote = ray.remote(run_job_on_worker)
        options = {**TASK_DEFAULTS, **OmegaConf.to_container(self.ray_cfg.remote, resolve=True)}
        # What every job shares, stored in the cluster once rather than sent with each job
        shared = [ray.put(x) for x in (self.hydra_context, self.task_function)]
        state, env, cwd = ray.put(Singleton.get_state()), job_env(), os.getcwd()
        jobs = []
        for num, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info(f"\t#{num} : {' '.join(filter_overrides(overrides))}")
            config = self.hydra_context.config_loader.load_sweep_config(
                self.config, list(overrides)
            )
            with open_dict(config):
                config.hydra.job.id = f"job_id_for_{num}"
                config.hydra.job.num = num
            context, task = shared
            ref = remote.options(**options, name=f"job{num}").remote(
                context, config, task, state, env, cwd
            )
            jobs.append(Job(num, list(overrides), config, ref))
        with sigterm_as_interrupt():
            return self.wait(jobs, options["max_retries"])

    def wait(self, jobs: list[Job], retries: int) -> list[JobReturn]:
        """Each job's return as it ends; on an interrupt (Ctrl-C, or a SIGTERM,
        which Ray's wait turns into a plain KeyboardInterrupt), cancel the rest and
        exit with the signal's status."""
        returns: dict[int, JobReturn] = {}
        pending = {job.ref: job for job in jobs}
        bar = sweep_bar(jobs)
        try:
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S)
                for ref in done:
                    job = pending.pop(ref)
                    returns[job.num] = self.job_return(job, retries)
                    if bar is not None:
                        bar.update(1)
        except KeyboardInterrupt as e:
            cancel(list(pending))
            print("interrupted", file=sys.stderr, flush=True)
            raise SystemExit(exit_status(Terminated() if sigterm_received() else e)) from None
        finally:
            if bar is not None:
                bar.close()
        return [returns[job.num] for job in jobs]

    def job_return(self, job: Job, retries: int) -> JobReturn:
        """The job's return from its worker, or a FAILED one where the task itself
        failed: its worker died on every try, or it raised outside the job."""
        try:
            node, ret = ray.get(job.ref)
        except ray.exceptions.RayTaskError as e:  # e.g. the node lacks the working directory
            cause = e.cause if isinstance(e.cause, BaseException) else e
            return self.failed(job, cause)
        except ray.exceptions.RayError as e:
            tries = f"each of its {1 + retries} tries" if retries > 0 else "its one try"
            reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
            died = f"the Ray worker running it died on {tries} ({type(e).__name__}: {reason})"
            return self.failed(job, WorkerDied(died))
        log.info(f"\t#{job.num} ran on node {node}")
        return ret

    def failed(self, job: Job, error: BaseException) -> JobReturn:
        """A FAILED return for ``job``, recorded by the sweep's callbacks (its folder's
        failed job record, the summary) as its worker would have."""
        assert self.hydra_context is not None
        previous = HydraConfig.instance().cfg
        config = copy.deepcopy(job.config)
        HydraConfig.instance().set_config(config)
        run_dir = job_dir(config)
        with read_write(config.hydra.runtime), open_dict(config.hydra.runtime):
            config.hydra.runtime.output_dir = str(run_dir)
        HydraConfig.instance().set_config(config)
        if config.hydra.output_subdir is not None:  # the summary's row names the job's settings
            saved = run_dir / str(config.hydra.output_subdir) / "overrides.yaml"
            if not saved.exists():
                saved.parent.mkdir(parents=True, exist_ok=True)
                OmegaConf.save(OmegaConf.create(job.overrides), saved)
        ret = JobReturn(
            overrides=job.overrides,
            hydra_cfg=copy.deepcopy(HydraConfig.instance().cfg),
            working_dir=os.getcwd(),
            task_name=str(config.hydra.job.name),
            status=JobStatus.FAILED,
            _return_value=error,
        )
        try:
            self.hydra_context.callbacks.on_job_end(config=config, job_return=ret)
        finally:
            if previous is not None:
                HydraConfig.instance().set_config(previous)
        return ret


def sweep_bar(jobs: list[Job]):
    """A progress bar over ``jobs`` on the sweep's terminal, where they would show
    their own (``progress=true``) and stderr is one; else None."""
    if not sys.stderr.isatty() or not any(
        OmegaConf.select(job.config, "progress", default=False) for job in jobs
    ):
        return None
    from tqdm import tqdm

    return tqdm(total=len(jobs), unit="job", desc="sweep", dynamic_ncols=True)


def connect(init: DictConfig) -> None:
    """Join the cluster ``init.address`` names (null: the one ``ray start`` began on
    this machine, else a new one for this process; ``auto``: only an existing one),
    with ``init``'s other arguments where they are set."""
    if ray.is_initialized():
        return
    kwargs = OmegaConf.to_container(init, resolve=True)
    kwargs = {k: v for k, v in kwargs.items() if v is not None or k == "address"}
    try:
        ray.init(**kwargs)
    except ConnectionError as e:
        raise ConnectionError(
            f"{e}. Is a Ray head running there (ray start --head ...)? A head started "
            "with token authentication (Ray's default) also needs RAY_AUTH_MODE=token here, "
            "with its token in ~/.ray/auth_token or RAY_AUTH_TOKEN (docs/usage.md, "
            "'Cluster sweeps')"
        ) from e


def cluster_resources() -> str:
    """The cluster's CPUs and nodes, for the sweep's log."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    cpus = ray.cluster_resources().get("CPU", 0)
    return f"{len(nodes)} node{'s' * (len(nodes) != 1)}, {cpus:g} CPUs"


def cancel(refs: list[Any]) -> None:
    """Cancel the tasks ``refs``: one not started never starts; a running one is
    interrupted (KeyboardInterrupt) and given :data:`GRACE_S` to write what it
    measured, or killed at a second interrupt."""
    if not refs:
        return
    print(f"\ncancelling {len(refs)} job(s) of the sweep ...", file=sys.stderr, flush=True)
    for ref in refs:
        ray.cancel(ref)
    try:
        ray.wait(refs, num_returns=len(refs), timeout=GRACE_S)
    except KeyboardInterrupt:
        for ref in refs:
            ray.cancel(ref, force=True)
