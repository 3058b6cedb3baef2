"""The search's rounds on a synthetic metric (no simulator): bracketing and
bisection find each configuration's rate, branch and bound keeps the winner."""

from __future__ import annotations

import pytest

from testbed.search.search import (
    CONVERGED,
    FAILED,
    FLOOR,
    PRUNED,
    Outcome,
    Search,
    SearchError,
)
from testbed.search.slo import SLO
from testbed.search.space import Space
from tests.search.helpers import SLOS, SMALL_SPACE, Synthetic, synthetic_search


def test_bisection_finds_the_highest_rate_meeting_each_slo_within_the_tolerance():
    search, model = synthetic_search(bound=False, rel_tol=0.02)
    search.run(model.launch)
    assert search.done()
    for (n, name), iv in search.intervals.items():
        dep, slo = search.deps[n], next(s for s in SLOS if s.name == name)
        truth = model.truth(dep, slo) * dep.gpus
        assert iv.status == CONVERGED
        assert iv.lo <= truth < iv.hi <= iv.lo * 1.02, (dep.id, name)


def test_the_start_may_be_far_off_either_way():
    deps = Space.of(SMALL_SPACE).expand()[:3]
    model = Synthetic(deps, 1)
    for factor in (1 / 300, 300):
        starts = {d.num: d.gpus * model.capacity[d.num] * factor for d in deps}
        search = Search(deps, SLOS, starts, bound=False, max_steps=12)
        search.run(model.launch)
        for (n, name), iv in search.intervals.items():
            slo = next(s for s in SLOS if s.name == name)
            assert iv.lo <= model.truth(search.deps[n], slo) * search.deps[n].gpus < iv.hi


@pytest.mark.parametrize("seed", range(6))
def test_branch_and_bound_finds_the_exhaustive_winner_with_fewer_simulations(seed):
    full, model = synthetic_search(seed, bound=False)
    full.run(model.launch)
    pruned, model = synthetic_search(seed, bound=True)
    pruned.run(model.launch)
    for slo in SLOS:
        truth = max(model.truth(d, slo) for d in pruned.deps.values())
        winner = max(pruned.deps, key=lambda n: model.truth(pruned.deps[n], slo))
        rate, holder = pruned.best(slo.name)
        # the winner is never pruned: it converges, and the best found is within tolerance
        assert pruned.intervals[(winner, slo.name)].status == CONVERGED
        assert truth / (1 + pruned.rel_tol) <= rate <= truth
        assert rate == pytest.approx(full.best(slo.name)[0], rel=pruned.rel_tol)
    assert len(pruned.runs) < 0.6 * len(full.runs)
    pruned_pairs = [iv for iv in pruned.intervals.values() if iv.status == PRUNED]
    assert pruned_pairs and all("no more than" in iv.reason for iv in pruned_pairs)


def test_one_run_is_judged_against_every_slo_of_its_configuration():
    search, model = synthetic_search(bound=False)
    batch = search.plan()
    dep, rate = batch[0]
    run = search.record(dep, rate, model.launch([(dep, rate)])[0])
    assert set(run.met) == {"tight", "loose"}
    for slo in SLOS:
        iv = search.intervals[(dep.num, slo.name)]
        assert (iv.lo == rate) == run.met[slo.name] and (iv.hi == rate) != run.met[slo.name]


def test_a_pair_below_its_latency_floor_is_never_simulated_for_it():
    deps = Space.of(SMALL_SPACE).expand()
    model = Synthetic(deps, 0)
    starts = {d.num: d.gpus * model.capacity[d.num] for d in deps}
    floors = {(d.num, "tight"): "TPOT floor above the target" for d in deps}
    search = Search(deps, [SLOS[0]], starts, floor_misses=floors)
    assert search.plan() == []
    assert all(iv.status == FLOOR and iv.reason for iv in search.intervals.values())


def test_a_failed_run_stops_its_configuration_with_the_reason():
    search, model = synthetic_search(bound=False)
    batch = search.plan()
    search.round = 1
    for i, (dep, rate) in enumerate(batch):
        outcome = Outcome(None, "RuntimeError: boom") if i == 0 else model.launch([(dep, rate)])[0]
        search.record(dep, rate, outcome)
    failed = batch[0][0].num
    for slo in SLOS:
        iv = search.intervals[(failed, slo.name)]
        assert iv.status == FAILED and "boom" in iv.reason
    assert all(d.num != failed for d, _ in search.plan())


def test_a_first_round_that_fails_entirely_stops_the_search_naming_the_error():
    search, _ = synthetic_search()
    with pytest.raises(SearchError, match="no such file"):
        search.run(lambda batch: [Outcome(None, "OSError: no such file") for _ in batch])


def test_an_slo_no_configuration_can_meet_ends_unmet():
    impossible = SLO("impossible", 0.05, 0.02)  # below the idle TTFT of 0.1 s
    search, model = synthetic_search(slos=[impossible], max_steps=4)
    search.run(model.launch)
    assert search.best("impossible") is None
    assert all(iv.status in ("unmet", "pruned") for iv in search.intervals.values())


def test_configurations_that_tie_follow_one_of_them_at_two_runs_each():
    deps = Space.of(SMALL_SPACE).expand()[:8]  # alike but for max_num_seqs and policy
    model = Synthetic(deps, 0)
    model.capacity = {d.num: 1.0 for d in deps}  # knobs that do not bind: all tie
    slo = SLOS[0]

    def searched(group):
        starts = {d.num: d.gpus * 1.3 for d in group}
        search = Search(group, [slo], starts, probes=1)
        search.run(model.launch)
        return search

    alone, ties = searched(deps[:1]), searched(deps)
    assert len(ties.runs) <= len(alone.runs) + 2 * (len(deps) - 1)
    assert ties.round <= alone.round + 2  # the followers' two runs go all at once
    truth = model.truth(deps[0], slo)  # per GPU, the same for all
    for n, dep in ties.deps.items():
        iv = ties.intervals[(n, slo.name)]
        assert iv.status == CONVERGED and iv.lo <= truth * dep.gpus < iv.hi
