"""What the search rules out before simulating (budget, validity, memory), and
the latency floors it prunes with, against the simulator itself."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from testbed.build import run_trace
from testbed.config_schema import compose_config
from testbed.errors import InputError
from testbed.job import run_from_config
from testbed.metrics.summary import statistics
from testbed.search.bounds import Bounds
from testbed.search.checks import (
    BUDGET,
    INVALID,
    MEMORY,
    Checker,
    Fit,
    TraceStats,
    check_all,
    shared_prefix_blocks,
)
from testbed.search.slo import SLO
from testbed.search.space import Space

QUIET = ["logging=disabled", "progress=false", "plots=false"]
BASE = [*QUIET, "model=llama3-70b", "hardware=h100", "trace=synthetic", "trace.num_requests=40"]
ONE = dict(
    replicas=[1], tensor_parallel=[1], pipeline_parallel=[1], split=["colocated"],
    max_num_seqs=[64], max_num_batched_tokens=[2048], chunked_prefill=[True],
    policy=["fcfs"], router=["least_outstanding"],
)  # fmt: skip


@pytest.fixture(scope="module")
def checker():
    cfg = compose_config(BASE)
    return Checker(cfg, run_trace(cfg), budget=8)


def dep(**knobs):
    return Space.of(ONE | {k: [v] for k, v in knobs.items()}).expand()[0]


def test_a_70b_model_on_one_gpu_is_dropped_for_its_memory(checker):
    rule, reason = checker.check(dep())
    assert rule == MEMORY
    assert "no room for a KV cache" in reason and "tensor_parallel_size=1" in reason


def test_what_breaks_the_budget_or_the_model_or_the_engine_is_dropped_naming_why(checker):
    assert checker.check(dep(tensor_parallel=8, replicas=2)) == (
        BUDGET, "16 GPUs, over the budget of 8",
    )  # fmt: skip
    rule, reason = checker.check(dep(tensor_parallel=3))
    assert rule == INVALID and "64 attention heads, not divisible" in reason
    rule, reason = checker.check(dep(tensor_parallel=4, chunked_prefill=False))
    assert rule == INVALID and "without chunked prefill" in reason
    rule, reason = checker.check(dep(tensor_parallel=4, split="1:1"))
    assert rule == INVALID and "multiple of 2 instances" in reason


def test_what_fits_is_kept_with_its_kv_cache(checker):
    fit = checker.check(dep(tensor_parallel=4))
    assert isinstance(fit, Fit) and fit.kv_tokens > 100_000
    assert fit.engine["tensor_parallel_size"] == 4
    space = Space.of(ONE | {"tensor_parallel": [1, 2, 4, 8], "pipeline_parallel": [1, 2]})
    kept, dropped = check_all(checker, space.expand())
    assert len(kept) + len(dropped) == space.size
    deps = space.expand()
    assert sorted(deps[n].shape for n in kept) == [
        "TP2 PP2 x 1", "TP4 PP1 x 1", "TP4 PP2 x 1", "TP8 PP1 x 1",
    ]  # fmt: skip
    by_rule = {deps[n].shape: rule for n, (rule, _) in dropped.items()}
    # 140 GB of weights: over 2 GPUs 70 GB each, beyond 80 GB x 0.9 less the activations
    assert by_rule == {
        "TP1 PP1 x 1": MEMORY, "TP2 PP1 x 1": MEMORY, "TP1 PP2 x 1": MEMORY,
        "TP8 PP2 x 1": BUDGET,
    }  # fmt: skip


def test_a_trace_longer_than_the_model_takes_is_refused_with_the_fix():
    cfg = compose_config([*BASE, "model=llama3-8b", "engine.max_model_len=256"])
    with pytest.raises(InputError, match=r"trace.max_model_len"):
        Checker(cfg, run_trace(cfg), budget=8)


def test_a_prompt_may_be_cached_only_as_far_as_another_prompt_shares_its_prefix():
    assert shared_prefix_blocks([(1, 2, 3), (1, 2, 4), (5,), (), (1, 2, 3)]) == [3, 2, 0, 0, 3]
    trace = pd.DataFrame(
        {"prompt_tokens": [1000, 300, 100], "output_tokens": [5, 5, 5],
         "prefix_hash_ids": [(7, 8), (7, 9), None]}
    )  # fmt: skip
    trace.attrs["hash_block_tokens"] = 512
    stats = TraceStats.of(trace)
    # 512 of the first (one block shared); the second is shorter than the block: all
    # but its last token; the third shares nothing
    assert stats.cacheable.tolist() == [512, 299, 0]


@pytest.mark.parametrize("shared", [False, True])
def test_the_latency_floors_are_under_what_a_light_run_measures(tmp_path, shared):
    overrides = [*BASE, "model=llama3-8b", "trace.rate=0.5", "trace.num_requests=30"]
    if shared:
        overrides.append("trace.shared_prefix={num_prefixes: 2, tokens: 512, fraction: 0.8}")
    cfg = compose_config(overrides)
    checker = Checker(cfg, run_trace(cfg), budget=8)
    d = dep()
    fit = checker.check(d)
    bounds = Bounds(cfg, checker.stats)
    ttft, tpot = bounds.floors(d, fit)
    metrics = run_from_config(cfg, tmp_path / "run")
    for p in ("p50", "p90", "p99", "mean"):
        # (times in a run are differences of clock readings: equal up to rounding)
        assert statistics(ttft, (p,))[p] <= metrics[f"ttft_s_{p}"] * (1 + 1e-9)
        assert statistics(tpot, (p,))[p] <= metrics[f"tpot_s_{p}"] * (1 + 1e-9)
    # nearly idle, the floors are close to what it measures
    assert statistics(tpot, ("p50",))["p50"] > 0.8 * metrics["tpot_s_p50"]
    if shared:  # the run found shared prefixes; the floors allowed for every one
        assert metrics["prefix_cache_hit_rate"] > 0 and checker.stats.cacheable.max() > 0
    tight = SLO("tight", 1.0, 0.5 * statistics(tpot, ("p99",))["p99"])
    assert "TPOT at p99 is at least" in bounds.floor_miss(d, fit, tight)
    assert bounds.floor_miss(d, fit, SLO("loose", 10.0, 1.0)) is None
    assert np.isnan(tpot[checker.stats.output < 2]).all()
    assert bounds.capacity(d, fit) > 0
