"""The search's space and SLOs: what a knob list expands to, the overrides a
configuration runs with, and bad input named by its field."""

from __future__ import annotations

import pytest

from testbed.errors import InputError
from testbed.search.slo import SLO, parse_slo, parse_slos
from testbed.search.space import KNOBS, Space
from tests.search.helpers import SMALL_SPACE


def test_the_space_is_the_product_of_its_lists_in_the_knobs_order():
    space = Space.of(SMALL_SPACE | {"split": ["colocated", "1:1"]})
    deps = space.expand()
    assert space.size == len(deps) == 2 * 3 * 2 * 3 * 2
    assert [d.num for d in deps] == list(range(len(deps)))
    assert len({tuple(d.knobs().values()) for d in deps}) == len(deps)
    first = deps[0]
    assert first.knobs() == {k: v[0] for k, v in SMALL_SPACE.items()}
    assert {d.policy for d in deps[:2]} == {"fcfs", "sjf"}  # the last knob varies fastest


def test_a_configuration_runs_with_the_overrides_of_its_knobs():
    knobs = SMALL_SPACE | {"replicas": [4], "tensor_parallel": [2], "split": ["1:3"]}
    dep = Space.of({k: v[:1] for k, v in knobs.items()}).expand()[0]
    assert dep.gpus == 8 and dep.shape == "TP2 PP1 1P3D"
    assert dep.overrides() == [
        "engine.tensor_parallel_size=2", "engine.pipeline_parallel_size=1",
        "engine.max_num_seqs=64", "engine.max_num_batched_tokens=2048",
        "engine.enable_chunked_prefill=true", "policy=fcfs", "cluster=disagg",
        "cluster.num_prefill=1", "cluster.num_decode=3", "cluster.router=least_outstanding",
    ]  # fmt: skip
    colocated = Space.of({k: v[:1] for k, v in SMALL_SPACE.items()}).expand()[0]
    assert "cluster=single" in colocated.overrides()
    assert "cluster.num_replicas=1" in colocated.overrides()


def test_a_split_that_does_not_divide_the_instances_says_so():
    dep = Space.of({k: v[:1] for k, v in SMALL_SPACE.items()} | {"split": ["1:1"]}).expand()[0]
    with pytest.raises(ValueError, match="multiple of 2 instances, not 1"):
        dep.pools()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"foo": [1]}, r"space\.foo: no such knob"),
        ({"tensor_parallel": []}, r"space\.tensor_parallel: an empty list"),
        ({"tensor_parallel": [0]}, r"space\.tensor_parallel: 0 is not one of integers >= 1"),
        ({"split": ["2-1"]}, r"space\.split: '2-1'"),
        ({"policy": ["fifo"]}, r"space\.policy: 'fifo'"),
        ({"chunked_prefill": ["yes"]}, r"space\.chunked_prefill: 'yes'"),
    ],
)
def test_a_bad_knob_or_value_is_named(change, message):
    with pytest.raises(InputError, match=message):
        Space.of(SMALL_SPACE | change)


def test_a_knob_left_out_is_named():
    knobs = {k: v for k, v in SMALL_SPACE.items() if k != "router"}
    with pytest.raises(InputError, match=r"space\.router: no values"):
        Space.of(knobs)
    assert set(SMALL_SPACE) == set(KNOBS)


def test_slos_parse_from_text_and_mappings():
    assert parse_slo("tight:0.5:0.03@p90", "s") == SLO("tight", 0.5, 0.03, "p90")
    assert parse_slo("loose:2:0.1", "s").percentile == "p99"
    mapping = {"name": "m", "ttft_s": 1, "tpot_s": 0.05, "percentile": "mean"}
    assert parse_slo(mapping, "s") == SLO("m", 1.0, 0.05, "mean")


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        (["ok:1:0.1", "tight:0.5"], r"slos\[1\]='tight:0.5': not an SLO"),
        (["tight:0.5:0.03@p95"], r"slos\[0\]='tight:0.5:0.03@p95': percentile 'p95'"),
        (["tight:fast:0.03"], r"slos\[0\]='tight:fast:0.03'"),
        (["a:-1:0.03"], r"ttft_s=-1.0 must be"),
        ([{"name": "a", "ttft_s": 1, "tpot": 0.1}], r"slos\[0\]\.tpot: no such field"),
        (["a:1:0.1", "a:2:0.2"], r"SLO name 'a' is given twice"),
        ([], "no SLO given"),
        ("a:1:0.1", "a list of SLOs"),
    ],
)
def test_a_bad_slo_is_named_with_its_place_in_the_list(specs, message):
    with pytest.raises(InputError, match=message):
        parse_slos(specs, "slos")


def test_an_slo_is_met_only_served_in_full_kept_up_with_and_within_both_targets():
    slo = SLO("s", 1.0, 0.05)
    ok = {"num_requests": 5, "num_finished": 5, "num_rejected": 0,
          "ttft_s_p99": 1.0, "tpot_s_p99": 0.05}  # fmt: skip
    assert slo.met_by(ok)
    assert not slo.met_by(ok | {"num_finished": 4})
    assert not slo.met_by(ok | {"num_rejected": 1})
    assert not slo.met_by(ok | {"overloaded": True})  # the trace's end let it through
    assert slo.met_by(ok | {"overloaded": None})  # too short a trace for a verdict
    assert not slo.met_by(ok | {"ttft_s_p99": 1.01})
    assert not slo.met_by(ok | {"tpot_s_p99": float("nan")})
