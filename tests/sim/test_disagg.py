"""Disaggregated prefill/decode in the simulator: every request prefilled on a
prefill replica, its prompt's KV moved over the modelled link, decoded on a
decode replica; TTFT includes the transfer; deciders; blocks freed."""

from __future__ import annotations

import itertools

import pandas as pd
import pytest

from testbed.errors import InputError
from testbed.models import ModelSpec
from testbed.sim.link import LinkSpec
from tests.sim.helpers import run

DISAGG = ("cluster=disagg", "trace.num_requests=60")


def frame(tmp_path, name="run") -> pd.DataFrame:
    return pd.read_csv(tmp_path / name / "requests.csv")


def bytes_per_token() -> int:
    from testbed.build import model_spec
    from testbed.config_schema import compose_config

    cfg = compose_config([])
    spec: ModelSpec = model_spec(cfg.model)
    return spec.kv_bytes_per_token(cfg.model.dtype)


def test_every_request_is_prefilled_moved_and_decoded(tmp_path):
    m = run(tmp_path, *DISAGG)
    df = frame(tmp_path)
    assert m["num_finished"] == 60 and m["num_disaggregated"] == 60
    assert (m["num_prefill"], m["num_decode"], m["kv_transfers"]) == (1, 1, 60)
    # The prompt's KV but its last token (computed on the decode side).
    assert (df.kv_transfer_bytes == (df.prompt_tokens - 1) * bytes_per_token()).all()
    assert m["kv_transfer_bytes"] == df.kv_transfer_bytes.sum()
    # TTFT covers the transfer: the first token comes after the KV arrived.
    assert (df.kv_transfer_start_s >= df.arrival_s).all()
    assert (df.kv_transfer_end_s > df.kv_transfer_start_s).all()
    assert (df.first_token_s > df.kv_transfer_end_s).all()
    assert not df.kv_transfer_failed.any()
    assert 0 < m["prefill_pool_utilization"] < 1 and 0 < m["decode_pool_utilization"] <= 1
    steps = pd.read_csv(tmp_path / "run" / "steps.csv")
    prefill = steps[steps.replica == 0]
    # The prefill replica computes prompts and one token each, never decodes.
    assert prefill.num_decode_tokens.sum() == 0
    assert prefill.num_prefill_tokens.sum() == df.prompt_tokens.sum() - df.cached_tokens.sum()


def test_a_lone_transfer_takes_the_links_latency_plus_bytes_over_bandwidth(tmp_path):
    pcie = LinkSpec.preset("pcie")
    run(tmp_path, "cluster=disagg", "trace.num_requests=1", "cluster.link=pcie")
    (row,) = frame(tmp_path).itertuples()
    took = row.kv_transfer_end_s - row.kv_transfer_start_s
    assert took == pytest.approx(pcie.alone_s(row.kv_transfer_bytes), rel=1e-9)
    # A slower link: the same request's first token later by the difference.
    run(
        tmp_path, "cluster=disagg", "trace.num_requests=1", "cluster.link=pcie",
        "cluster.link_bandwidth_bytes_s=1e9", name="slow",
    )  # fmt: skip
    (slow,) = frame(tmp_path, "slow").itertuples()
    extra = row.kv_transfer_bytes / 1e9 - row.kv_transfer_bytes / pcie.bandwidth_bytes_s
    assert slow.ttft_s - row.ttft_s == pytest.approx(extra, rel=1e-6)


def test_deciders_choose_which_requests_move(tmp_path):
    never = run(tmp_path, *DISAGG, "cluster.decider=never", name="never")
    assert never["num_disaggregated"] == 0 and "kv_transfers" not in never  # none moved
    assert never["num_finished"] == 60 and never["prefill_pool_utilization"] == 0
    some = run(
        tmp_path, *DISAGG, "cluster.decider=uncached_prompt",
        "+cluster.decider_args.threshold=600", name="some",
    )  # fmt: skip
    df = frame(tmp_path, "some")
    moved = df.kv_transfer_bytes > 0
    assert some["num_disaggregated"] == moved.sum() and 0 < moved.sum() < 60
    assert (df.prompt_tokens[moved] > 600).all() and (df.prompt_tokens[~moved] <= 600).all()


def test_transfers_share_a_link_and_blocks_come_back(tmp_path):
    """2 prefill and 2 decode replicas under load on a slow link: transfers overlap
    and share it; every prefill block is freed once its KV has been sent."""

    sim, result, extra = simulate_disagg(
        "cluster.num_prefill=2", "cluster.num_decode=2",
        "cluster.link_bandwidth_bytes_s=2e7", "trace.num_requests=80", "trace.rate=20",
    )  # fmt: skip
    assert sim.num_prefill == 2 and len(sim.core.decode_pool) == 2
    assert sum(r.kv_transfer_bytes > 0 for r in result.requests) == 80
    assert extra["kv_link_utilization_max"] > 0
    ends = sorted((r.kv_transfer_start, r.kv_transfer_end) for r in result.requests)
    overlapping = sum(1 for a, b in itertools.pairwise(ends) if b[0] < a[1])
    assert overlapping > 5
    alone = [
        r.kv_transfer_end - r.kv_transfer_start - r.kv_transfer_bytes / 2e7 for r in result.requests
    ]
    assert max(alone) > 1e-3  # some shared the link and took longer than alone
    assert all(r.status.name.startswith("FINISHED") for r in result.requests)
    assert_every_block_back(sim)


def simulate_disagg(*overrides: str):
    """A disaggregated simulation in this process: the simulation object (to look
    into its replicas after the run), its result and its metrics fields."""
    from testbed.build import load_requests, model_spec
    from testbed.config_schema import compose_config
    from testbed.modes.sim import simulate
    from testbed.sim.disagg import DisaggSimulation

    cfg = compose_config(["mode=sim", "cluster=disagg", *overrides])
    spec = model_spec(cfg.model)
    _, requests = load_requests(cfg, spec)
    sims = []
    run_sim = DisaggSimulation.run

    def keep(self):
        sims.append(self)
        return run_sim(self)

    DisaggSimulation.run = keep
    try:
        result, extra = simulate(cfg, requests, spec)
    finally:
        DisaggSimulation.run = run_sim
    return sims[0], result, extra


def assert_every_block_back(sim) -> None:
    for rep in sim.replicas:  # every block back, nothing still being sent or loaded
        sched = rep.engine.scheduler
        assert not sched.sending and not sched.loading
        assert sched.kv.num_free_blocks == sched.kv.num_blocks


@pytest.mark.parametrize("kind", ["fail", "hang"])
def test_a_failed_transfer_is_recomputed_on_the_decode_side(tmp_path, kind):
    """Injected faults: the struck transfers (by request id) fail after the link's
    latency or at the timeout; each request recomputes its prompt on the decode
    replica and is served; the prefill replica frees the blocks; metrics count it."""
    from testbed.core.kv_faults import KVFaults

    overrides = (
        "trace.num_requests=60", f"cluster.kv_fault={kind}", "cluster.kv_fault_rate=0.3",
        "cluster.kv_transfer_timeout_s=0.25", "seed=3",
    )  # fmt: skip
    sim, result, _ = simulate_disagg(*overrides)
    faults = KVFaults(kind, 0.3, 3)
    struck = {r.request_id for r in result.requests if faults.strikes(r.request_id)}
    failed = {r.request_id for r in result.requests if r.kv_transfer_failed}
    assert failed == struck and 5 < len(failed) < 40
    assert all(r.status.name.startswith("FINISHED") for r in result.requests)
    link = LinkSpec.preset("nvlink")
    for r in result.requests:
        took = r.kv_transfer_end - r.kv_transfer_start
        if r.kv_transfer_failed:
            assert took == pytest.approx(0.25 if kind == "hang" else link.latency_s)
            assert r.kv_transfer_bytes == 0 and r.kv_recomputed_tokens == r.num_prompt_tokens - 1
            assert r.first_token_time > r.kv_transfer_end
        else:
            assert r.kv_transfer_bytes > 0 and r.kv_recomputed_tokens == 0
    assert_every_block_back(sim)
    m = run(tmp_path, "cluster=disagg", *overrides)
    assert m["kv_transfers_failed"] == len(failed) and m["kv_transfers"] == 60 - len(failed)
    assert m["kv_recomputed_tokens"] == sum(r.kv_recomputed_tokens for r in result.requests)
    # The decode replica computed the failed prompts, all but what its cache held.
    steps = sim.steps.to_frame()
    decode_prefill = steps[steps.replica == 1].num_prefill_tokens.sum()
    recomputed = sum(r.kv_recomputed_tokens for r in result.requests)
    assert recomputed > 0 and decode_prefill <= recomputed + len(failed)
    assert decode_prefill >= recomputed - sum(
        r.num_cached_tokens for r in result.requests if r.kv_transfer_failed
    )


def test_disaggregation_needs_both_pools(tmp_path):
    with pytest.raises(InputError, match="num_decode=0: disaggregation needs both"):
        run(tmp_path, "cluster=disagg", "cluster.num_decode=0")
    with pytest.raises(InputError, match=r"cluster\.link=wifi: must be one of"):
        run(tmp_path, "cluster=disagg", "cluster.link=wifi")


@pytest.mark.parametrize(
    "extra",
    [
        (),
        ("cluster.num_prefill=2", "cluster.num_decode=3", "cluster.link_bandwidth_bytes_s=5e7"),
        ("cluster.decider=uncached_prompt", "+cluster.decider_args.threshold=500"),
        ("cluster.kv_fault=hang", "cluster.kv_fault_rate=0.2", "cluster.kv_transfer_timeout_s=0.3"),
    ],
)
def test_the_fast_path_gives_a_disaggregated_run_the_results_of_stepping(tmp_path, extra):
    """Its jumps stop before every event that may touch a replica (arrivals, legs
    handed over, transfers ending): requests and steps identical on and off."""
    common = ("cluster=disagg", "trace.num_requests=150", "trace.rate=6", *extra)
    fast = run(tmp_path, *common, "mode.fast_forward=true", name="fast")
    slow = run(tmp_path, *common, "mode.fast_forward=false", name="slow")
    assert fast["num_jumped_steps"] > 0 and slow["num_jumped_steps"] == 0
    for name in ("requests.csv", "steps.csv"):
        a, b = (pd.read_csv(tmp_path / n / name) for n in ("fast", "slow"))
        pd.testing.assert_frame_equal(a, b)
    keys = [
        k for k, v in fast.items()
        if k.startswith(("kv_", "ttft", "e2e", "tpot")) and isinstance(v, int | float)
    ]  # fmt: skip
    assert fast["kv_link"] == slow["kv_link"]
    # Equal but for the last bit of sums over the step log, which the two log in
    # different orders (a jump's steps are logged together).
    assert {k: fast[k] for k in keys} == pytest.approx({k: slow[k] for k in keys}, rel=1e-12)


@pytest.mark.parametrize("decider", ["always", "uncached_prompt"])
def test_the_pairing_is_asked_once_per_request(monkeypatch, decider):
    """At the handover (or at arrival, for a decider that looks up the decode
    replica's cache, which then takes the request): a stateful pairing such as
    round robin turns once per request."""
    from policies.routers import RoundRobin

    calls: list[str] = []
    choose = RoundRobin.choose

    def counted(self, request, replicas, now):
        calls.append(request.request_id)
        return choose(self, request, replicas, now)

    monkeypatch.setattr(RoundRobin, "choose", counted)
    _, result, _ = simulate_disagg(
        "trace.num_requests=40", "cluster.num_decode=3", "cluster.pairing=round_robin",
        f"cluster.decider={decider}", "cluster.router=least_outstanding",
    )  # fmt: skip
    assert sorted(calls) == sorted(r.request_id for r in result.requests)
