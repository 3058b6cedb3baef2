"""A synthetic deployment search: each configuration's latencies grow with its
load (its rate per GPU over a capacity per GPU drawn for it), so the highest
rate meeting an SLO is known in closed form and no simulator runs."""

from __future__ import annotations

import math
import random

from testbed.search.search import Outcome, Search
from testbed.search.slo import SLO
from testbed.search.space import Deployment, Space

SMALL_SPACE = dict(
    replicas=[1, 2],
    tensor_parallel=[1, 2, 4],
    pipeline_parallel=[1],
    split=["colocated"],
    max_num_seqs=[64, 128, 256],
    max_num_batched_tokens=[2048],
    chunked_prefill=[True],
    policy=["fcfs", "sjf"],
    router=["least_outstanding"],
)
TTFT_0, TPOT_0 = 0.1, 0.01  # latencies of an idle configuration


class Synthetic:
    """Latencies ``TTFT_0 * exp(2x)`` and ``TPOT_0 * (1 + 3x)`` at load ``x`` (rate
    per GPU over the configuration's capacity per GPU)."""

    def __init__(self, deployments: list[Deployment], seed: int) -> None:
        rng = random.Random(seed)
        self.capacity = {d.num: rng.uniform(0.5, 2.0) for d in deployments}
        self.calls = 0

    def metrics(self, dep: Deployment, rate: float) -> dict:
        x = rate / dep.gpus / self.capacity[dep.num]
        ttft, tpot = TTFT_0 * math.exp(2 * x), TPOT_0 * (1 + 3 * x)
        out = {"num_requests": 10, "num_finished": 10, "num_rejected": 0}
        for p in ("p50", "p90", "p99", "mean"):
            out |= {f"ttft_s_{p}": ttft, f"tpot_s_{p}": tpot}
        return out

    def launch(self, batch):
        self.calls += 1
        return [Outcome(self.metrics(d, r)) for d, r in batch]

    def truth(self, dep: Deployment, slo: SLO) -> float:
        """The highest rate per GPU meeting ``slo``."""
        x = min(math.log(slo.ttft_s / TTFT_0) / 2, (slo.tpot_s / TPOT_0 - 1) / 3)
        return x * self.capacity[dep.num]


def synthetic_search(seed: int = 0, bound: bool = True, **kwargs) -> tuple[Search, Synthetic]:
    deps = Space.of(SMALL_SPACE).expand()
    model = Synthetic(deps, seed)
    starts = {d.num: d.gpus * model.capacity[d.num] * 1.3 for d in deps}
    return Search(deps, kwargs.pop("slos", SLOS), starts, bound=bound, **kwargs), model


SLOS = [SLO("tight", 0.2, 0.02), SLO("loose", 1.0, 0.05, "p90")]
