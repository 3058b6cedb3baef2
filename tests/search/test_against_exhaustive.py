"""Branch and bound against the exhaustive search on a tiny space, with the
simulator: the same best configuration per SLO, from fewer simulations."""

from __future__ import annotations

import pytest

from testbed.config_schema import compose_config
from testbed.job import run_from_config
from testbed.search.driver import prepare, settings_of
from testbed.search.search import PRUNED, Outcome

BASE = [
    "logging=disabled", "progress=false", "plots=false", "outputs.steps_format=parquet",
    "model=llama3-8b", "hardware=h100", "trace=synthetic", "trace.num_requests=60",
]  # fmt: skip
SPACE = dict(
    replicas=[1, 2], tensor_parallel=[1], pipeline_parallel=[1], split=["colocated"],
    max_num_seqs=[4, 32], max_num_batched_tokens=[512, 2048], chunked_prefill=[True],
    policy=["fcfs"], router=["least_outstanding"],
)  # fmt: skip
SLOS = ["tight:0.15:0.012", "decode:0.3:0.0095", "prefill:0.1:0.02"]


def search(tmp_path, bound: bool):
    settings = settings_of(
        {"budget": 2, "slos": SLOS, "space": SPACE, "rel_tol": 0.1, "bound": bound, "probes": 1}
    )
    found, _ = prepare(settings, compose_config(BASE))
    runs, configs = [], {}

    def launch(batch):
        out = []
        for dep, rate in batch:
            if dep.num not in configs:  # composed once, the rate set per run
                configs[dep.num] = compose_config([*BASE, *dep.overrides()])
            cfg = configs[dep.num].copy()
            cfg.trace.rate = rate
            folder = tmp_path / f"{'bound' if bound else 'full'}-{len(runs)}"
            out.append(Outcome(run_from_config(cfg, folder)))
            runs.append(folder)
        return out

    found.run(launch)
    return found


@pytest.mark.slow
def test_branch_and_bound_keeps_the_winner_of_the_exhaustive_search(tmp_path):
    full = search(tmp_path, bound=False)
    pruned = search(tmp_path, bound=True)
    assert full.done() and pruned.done()
    winners = set()
    for slo in ("tight", "decode", "prefill"):
        best_full, best_pruned = full.best(slo), pruned.best(slo)
        assert best_full is not None
        # the same winner, or one within the tolerance of it
        assert best_pruned[0] >= best_full[0] / (1 + full.rel_tol)
        winner = best_full[1]
        assert pruned.intervals[(winner, slo)].status != PRUNED
        winners.add(winner)
    assert len(winners) > 1  # the SLOs were chosen so that their winners differ
    assert len(pruned.runs) < len(full.runs)
    assert any(iv.status == PRUNED for iv in pruned.intervals.values())
