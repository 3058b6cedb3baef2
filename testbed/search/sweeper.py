"""The deployment search as a Hydra sweeper: ``hydra/sweeper=deployment_search``
(``conf/experiment/deployment_search.yaml`` selects it).

Hydra builds a sweeper only from a class under the ``hydra_plugins`` package that
its plugin scan found, so ``hydra_plugins/testbed_search`` registers a subclass
of :class:`DeploymentSearchSweeper` and its config (:class:`DeploymentSearchConf`,
in group ``hydra/sweeper``); the search itself lives here and in
``testbed.search``. Each round of the search is one ``launcher.launch`` call of
ordinary run jobs (one simulation each), so whichever launcher the multirun
uses (basic, joblib, Ray) runs every simulation, a round's in parallel.

This module is imported by every Hydra start-up (the plugin scan): it imports
nothing heavy at module level.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.errors import CompactHydraException
from hydra.plugins.sweeper import Sweeper

TARGET = "hydra_plugins.testbed_search.DeploymentSearchSweeper"


@dataclass
class SpaceConf:
    """The values tried for each knob (``testbed/search/space.py`` says what each
    sets). The defaults suit Llama-3-70B on 8 H100s: the splits a 70B model's
    weights allow, colocated or one prefill to one decode instance."""

    replicas: list[int] = field(default_factory=lambda: [1, 2])
    tensor_parallel: list[int] = field(default_factory=lambda: [2, 4, 8])
    pipeline_parallel: list[int] = field(default_factory=lambda: [1, 2])
    split: list[str] = field(default_factory=lambda: ["colocated", "1:1"])
    max_num_seqs: list[int] = field(default_factory=lambda: [64, 256])
    max_num_batched_tokens: list[int] = field(default_factory=lambda: [2048, 8192])
    chunked_prefill: list[bool] = field(default_factory=lambda: [True, False])
    policy: list[str] = field(default_factory=lambda: ["fcfs", "sjf"])
    router: list[str] = field(default_factory=lambda: ["least_outstanding"])


@dataclass
class DeploymentSearchConf:
    """The search's settings (``hydra.sweeper.<field>=...``)."""

    _target_: str = TARGET
    budget: int = 8  # GPUs: a configuration uses at most this many
    # name:ttft_s:tpot_s[@percentile] (p99 unless given), or {name, ttft_s, tpot_s, percentile}
    slos: list[Any] = field(
        default_factory=lambda: [
            "tight_tpot:1:0.025@p90",
            "tight_ttft:0.3:0.1@p90",
            "relaxed:3:0.05@p90",
        ]
    )
    space: SpaceConf = field(default_factory=SpaceConf)
    # Each run replays this many requests per engine instance (the trace's first
    # N x instances), so that every configuration's instances see as much of the
    # trace, and fill up as early in it; null: the trace's own num_requests for all.
    requests_per_instance: int | None = 300
    rel_tol: float = 0.05  # a rate is found once bracketed this close (relative)
    probes: int = 4  # configurations that search each SLO before the rest are challenged
    bound: bool = True  # false: exhaustive (nothing pruned), to measure what pruning saves
    max_rounds: int = 60
    # The first rate tried, req/s per GPU; null: each configuration's estimated capacity.
    start_rate_per_gpu: float | None = None


class SearchInputError(CompactHydraException):
    """A bad search setting or command line: Hydra prints the message alone."""


class DeploymentSearchSweeper(Sweeper):
    """Runs :mod:`testbed.search` with the multirun's launcher."""

    def __init__(self, **settings: Any) -> None:
        super().__init__()
        self.settings = settings
        self.config = None
        self.launcher = None
        self.hydra_context = None

    def setup(self, *, hydra_context, task_function, config) -> None:
        from hydra.core.plugins import Plugins

        self.hydra_context, self.config = hydra_context, config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def sweep(self, arguments: list[str]) -> Any:
        from testbed.errors import InputError
        from testbed.search.driver import run_search

        try:
            return run_search(
                self.settings, self.config, self.launcher, self.hydra_context, arguments
            )
        except InputError as e:
            raise SearchInputError(str(e)) from e


def register_config() -> None:
    """Put :class:`DeploymentSearchConf` in Hydra's ``hydra/sweeper`` group."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(
        group="hydra/sweeper", name="deployment_search", node=DeploymentSearchConf,
        provider="testbed",
    )  # fmt: skip
