"""``hydra/launcher=ray``: its config, and the class Hydra makes from it.

Hydra imports every module here when it starts, so this one imports neither Ray
nor the published ``hydra-ray-launcher`` plugin (both an optional extra,
``pip install -e '.[ray]'``); the launcher itself, a subclass of the plugin's, is
``testbed/launchers/ray_launcher.py``, made when a sweep starts. The config
replaces the plugin's of the same name (a file in ``conf/`` of that name would be
merged with the plugin's, with a deprecation warning on every sweep), and keeps
its fields: ``ray.init`` (``ray.init``'s arguments) and ``ray.remote`` (each job's
task options). docs/usage.md, "Cluster sweeps".

No ``from __future__ import annotations`` here: Hydra runs this module before it
is in ``sys.modules``, where dataclasses cannot resolve string annotations.
"""

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn
from hydra.errors import CompactHydraException
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig


def _init_defaults() -> dict[str, Any]:
    return {
        # null: the cluster `ray start --head` began on this machine (or RAY_ADDRESS's),
        # else a Ray instance of the sweep's own; "auto": an existing one only;
        # "<head's ip>:6379": the head of a cluster elsewhere
        "address": None,
        # the sweep's own instance's CPUs (null: this machine's); not for an existing cluster
        "num_cpus": None,
        "include_dashboard": None,  # null: Ray's choice (on where its packages allow)
    }  # keys left null are not passed to ray.init


def _remote_defaults() -> dict[str, Any]:
    # a CPU a job; a job whose worker dies is retried this many times, then is a FAILED row
    return {"num_cpus": 1, "max_retries": 1}


@dataclass
class RayConf:
    init: dict[str, Any] = field(default_factory=_init_defaults)
    remote: dict[str, Any] = field(default_factory=_remote_defaults)


@dataclass
class TestbedRayLauncherConf:
    _target_: str = "hydra_plugins.testbed_launchers.testbed_ray_launcher.TestbedRayLauncher"
    ray: RayConf = field(default_factory=RayConf)


class RayNotInstalled(CompactHydraException):
    """``hydra/launcher=ray`` without Ray or its plugin (the message says how to install)."""


class TestbedRayLauncher(Launcher):
    """Hands the sweep to ``testbed.launchers.ray_launcher.RayLauncher``, made (and
    Ray imported) when the sweep is set up."""

    def __init__(self, ray: DictConfig) -> None:
        self.ray_cfg = ray
        self.launcher: Launcher | None = None

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        try:
            from testbed.launchers.ray_launcher import RayLauncher
        except ImportError as e:  # the extra is not installed: one line, no traceback
            raise RayNotInstalled(str(e)) from None

        self.launcher = RayLauncher(self.ray_cfg)
        self.launcher.setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        assert self.launcher is not None, "setup() first"
        return self.launcher.launch(job_overrides, initial_job_idx)


# Stored after the plugin's config of the same name, so that this one stands.
with contextlib.suppress(ImportError):
    import hydra_plugins.hydra_ray_launcher._config  # noqa: F401

ConfigStore.instance().store(
    group="hydra/launcher", name="ray", node=TestbedRayLauncherConf, provider="testbed"
)
