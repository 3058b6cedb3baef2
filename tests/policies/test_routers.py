"""Router policies: each one's rule on hand-made replica views, and prefix
affinity's effect in a simulated cluster with shared prefixes."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from policies.routers import ROUTERS, PrefixAffinity, make_router, prefix_key
from testbed.core import Request, Router


@dataclass
class View:
    index: int
    num_outstanding: int = 0
    num_outstanding_tokens: int = 0


def req(tokens=None, hash_ids=None, n=100) -> Request:
    return Request("r", prompt_token_ids=tokens, num_prompt_tokens=n, prefix_hash_ids=hash_ids)


def test_least_outstanding_tokens_weighs_prompts_not_requests():
    views = [View(0, 1, 4000), View(1, 5, 600), View(2, 5, 600)]
    assert make_router("least_outstanding_tokens").choose(req(), views, 0.0) == 1
    assert make_router("least_outstanding").choose(req(), views, 0.0) == 0


def test_power_of_two_takes_the_less_loaded_of_two_random_replicas():
    views = [View(i, num_outstanding=10 * i) for i in range(8)]
    router = make_router("power_of_two", seed=3)
    picks = [router.choose(req(), views, 0.0) for _ in range(2000)]
    # Never the most loaded (it loses every pair), and the least loaded whenever
    # drawn: 2 of 8 in a pair, 1 - (7/8)(6/7) = 1/4 of the time.
    assert 7 not in picks
    assert abs(picks.count(0) / 2000 - 0.25) < 0.03
    again = make_router("power_of_two", seed=3)
    assert picks == [again.choose(req(), views, 0.0) for _ in picks]  # seeded


def test_prefix_affinity_sends_a_prefix_to_one_replica_until_it_is_too_loaded():
    router = PrefixAffinity(block_tokens=4, blocks=2, imbalance=0.5, slack=2)
    views = [View(i) for i in range(4)]
    shared = [7, 7, 7, 7, 9, 9, 9, 9]
    homes = {router.choose(req(tokens=shared + [i, i + 1]), views, 0.0) for i in range(20)}
    assert len(homes) == 1  # the same first two blocks: the same replica
    home = homes.pop()
    spread = {router.choose(req(tokens=[i] * 8), views, 0.0) for i in range(40)}
    assert spread == {0, 1, 2, 3}  # other prefixes: all over
    views[home].num_outstanding = 3  # within 1.5 x 0 + 2? no: falls back to the least loaded
    assert router.choose(req(tokens=shared), views, 0.0) != home
    views[home].num_outstanding = 2
    assert router.choose(req(tokens=shared), views, 0.0) == home
    # Mooncake-style hash ids; a length-only request has no prefix: least loaded.
    assert prefix_key(req(hash_ids=[5, 6, 7]), 4, 2) == prefix_key(req(hash_ids=[5, 6, 9]), 4, 2)
    assert prefix_key(req(), 4, 2) is None
    assert router.choose(req(), [View(0, 3), View(1, 1)], 0.0) == 1


def test_prefix_affinity_keeps_a_prefix_home_when_a_replica_joins():
    """Rendezvous hashing: adding a replica moves only the prefixes it wins."""
    router = PrefixAffinity(block_tokens=4, blocks=1)
    four, five = [View(i) for i in range(4)], [View(i) for i in range(5)]
    moved = 0
    for i in range(400):
        r = req(tokens=[i, i, i, i])
        a, b = router.choose(r, four, 0.0), router.choose(r, five, 0.0)
        moved += a != b
        assert b in (a, 4)
    assert 40 < moved < 120  # about a fifth


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_every_router_runs_a_simulated_cluster(tmp_path, name):
    from tests.sim.helpers import run

    m = run(
        tmp_path, "cluster=replicas4", f"cluster.router={name}", "trace.num_requests=80",
        "+trace.shared_prefix={num_prefixes:4,tokens:1024,fraction:0.8}",
    )  # fmt: skip
    assert m["num_finished"] == 80 and m["router"] == name


def test_bad_router_options_are_refused_naming_them(tmp_path):
    from testbed.errors import InputError
    from tests.sim.helpers import run

    with pytest.raises(InputError, match=r"cluster.router=prefix_affinity .*imbalance"):
        run(tmp_path, "cluster=replicas4", "cluster.router=prefix_affinity",
            "+cluster.router_args.imbalance=-1")  # fmt: skip


def test_least_kv_usage_pairs_with_the_emptiest_cache_and_route_skips_a_lone_replica():
    @dataclass
    class KVView(View):
        kv_usage: float = 0.0

    views = [KVView(0, 1, kv_usage=0.6), KVView(1, 9, kv_usage=0.2), KVView(2, 0, kv_usage=0.2)]
    router = make_router("least_kv_usage")
    assert router.choose(req(), views, 0.0) == 2  # tie on usage: fewer outstanding
    assert router.route(req(), views[:1], 0.0) == 0


def test_a_disaggregated_simulation_takes_its_pairing_from_the_config(tmp_path):
    import pandas as pd

    from tests.sim.helpers import run

    m = run(
        tmp_path, "cluster=disagg", "cluster.num_decode=2", "cluster.pairing=round_robin",
        "trace.num_requests=40",
    )  # fmt: skip
    steps = pd.read_csv(tmp_path / "run" / "steps.csv")
    assert m["num_finished"] == 40 and set(steps.replica) == {0, 1, 2}


class LastReplica(Router):
    """A researcher's own router: always the last replica of the pool."""

    name = "last_replica"

    def choose(self, request, replicas, now):
        return len(replicas) - 1


def test_a_router_of_ones_own_runs_by_its_class_path(tmp_path):
    import pandas as pd

    from testbed.errors import InputError
    from tests.sim.helpers import run

    m = run(tmp_path, "cluster=replicas4", f"cluster.router={__name__}:LastReplica",
            "trace.num_requests=30")  # fmt: skip
    assert m["num_finished"] == 30
    steps = pd.read_csv(tmp_path / "run" / "steps.csv")
    assert set(steps.replica) == {3}
    with pytest.raises(InputError, match=r"cluster.router=policies.deciders:Always .*Router"):
        run(tmp_path, "cluster=replicas4", "cluster.router=policies.deciders:Always",
            name="wrong")  # fmt: skip
