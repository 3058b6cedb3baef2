"""Synthetic generators: seed-determinism and the statistics they promise."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from traces.schema import COLUMNS
from traces.synthetic import (
    arrivals,
    fixed,
    length_sampler,
    lognormal,
    synthetic_trace,
    uniform,
    zipf,
)
from traces.transforms import mean_rate

FIXED_3 = {"dist": "fixed", "value": 3}
N = 200_000  # large enough for ~1% tolerances, still a few ms


def _cv(x: np.ndarray) -> float:
    return float(np.std(x) / np.mean(x))


def test_default_trace_is_small_valid_and_seed_determined():
    df = synthetic_trace()
    assert len(df) == 200 and list(df.columns) == list(COLUMNS)
    assert {c: str(t) for c, t in df.dtypes.items()} == COLUMNS
    assert df["arrival_s"].iloc[0] == 0.0 and df["arrival_s"].is_monotonic_increasing
    assert df["prompt_tokens"].max() <= 1024 and df["output_tokens"].max() <= 512
    assert set(df["tenant"]) == {"interactive", "batch"}
    assert df.attrs["source"] == "synthetic" and df.attrs["hash_block_tokens"] == 512
    pd.testing.assert_frame_equal(df, synthetic_trace())
    assert df.attrs == synthetic_trace().attrs
    assert not df.equals(synthetic_trace(seed=1))


@pytest.mark.parametrize(("process", "cv"), [("poisson", 1.0), ("gamma", 0.5), ("gamma", 3.0)])
def test_arrivals_match_rate_and_cv(process, cv):
    t = arrivals(N, rate=5.0, process=process, cv=cv, rng=np.random.default_rng(0))
    assert t[0] == 0.0 and np.all(np.diff(t) >= 0)
    assert (N - 1) / t[-1] == pytest.approx(5.0, rel=0.02)
    assert _cv(np.diff(t)) == pytest.approx(cv, rel=0.05)


def test_arrivals_cv_zero_is_evenly_spaced_and_bad_process_is_an_error():
    assert np.allclose(np.diff(arrivals(10, 2.0, "gamma", cv=0.0)), 0.5)
    with pytest.raises(ValueError, match="arrival process"):
        arrivals(10, 1.0, process="weibull")


def test_length_samplers_match_their_means_and_bounds():
    rng = np.random.default_rng(0)
    x = lognormal(512, cv=1.0)(N, rng)
    assert x.mean() == pytest.approx(512, rel=0.02) and _cv(x) == pytest.approx(1.0, rel=0.05)
    y = lognormal(100, sigma=0.5)(N, rng)
    assert y.mean() == pytest.approx(100, rel=0.02)
    u = uniform(100, 200)(N, rng)
    assert u.min() == 100 and u.max() == 200 and u.mean() == pytest.approx(150, rel=0.01)
    assert set(fixed(7)(5, rng)) == {7}
    z = zipf(1.5, 2048)(N, rng)
    assert z.min() == 1 and z.max() <= 2048
    # P(1) / P(2) = 2^a for a Zipf law
    assert (z == 1).sum() / (z == 2).sum() == pytest.approx(2**1.5, rel=0.05)


def test_length_spec_dicts_clip_and_reject_bad_keys(tmp_path):
    rng = np.random.default_rng(0)
    x = length_sampler({"dist": "lognormal", "mean": 512, "cv": 1.0, "min": 10, "max": 600})(N, rng)
    assert x.min() == 10 and x.max() == 600
    f = tmp_path / "lengths.csv"
    f.write_text("num_prefill_tokens,num_decode_tokens\n3,4\n5,6\n")
    from_file = length_sampler({"dist": "file", "path": f, "column": "num_prefill_tokens"})
    assert set(from_file(100, rng)) == {3, 5}
    with pytest.raises(ValueError, match="dist"):
        length_sampler({"dist": "pareto"})
    with pytest.raises(ValueError, match="lognormal"):
        length_sampler({"dist": "lognormal", "mean": 5, "cv": 1, "typo": 3})


def test_tenant_mix_weights_priorities_slos_and_rate_scale():
    tenants = [
        {"name": "a", "weight": 0.7, "priority": 0, "ttft_slo_s": 1.0, "tpot_slo_s": 0.1},
        {"name": "b", "weight": 0.3, "priority": 2, "rate_scale": 2.0, "output": FIXED_3},
    ]
    df = synthetic_trace(num_requests=20_000, rate=10.0, tenants=tenants, seed=3)
    share_b = (df["tenant"] == "b").mean()
    assert share_b == pytest.approx(0.6 / 1.3, abs=0.02)  # weight x rate_scale
    assert mean_rate(df) == pytest.approx(10.0 * 1.3, rel=0.03)  # b's rate doubled
    a, b = df[df["tenant"] == "a"], df[df["tenant"] == "b"]
    assert set(a["priority"]) == {0} and set(b["priority"]) == {2}
    assert set(a["ttft_slo_s"]) == {1.0} and b["ttft_slo_s"].isna().all()
    assert set(b["output_tokens"]) == {3}
    with pytest.raises(ValueError, match="unknown keys"):
        synthetic_trace(tenants=[{"name": "x", "wieght": 1}])


def test_gamma_arrival_process_in_synthetic_trace():
    df = synthetic_trace(num_requests=50_000, rate=4.0, arrival="gamma", cv=2.0)
    assert mean_rate(df) == pytest.approx(4.0, rel=0.05)
    assert _cv(np.diff(df["arrival_s"].to_numpy())) == pytest.approx(2.0, rel=0.08)


def test_shared_prefix_blocks():
    block = 512
    spec = {"num_prefixes": 4, "tokens": 1024, "fraction": 0.5}
    df = synthetic_trace(num_requests=4000, shared_prefix=spec, seed=5)
    ids = df["prefix_hash_ids"].tolist()
    assert all(len(h) == math.ceil(p / block) for h, p in zip(ids, df["prompt_tokens"]))
    shared = np.array([h[0] < 4 * 2 for h in ids])  # ids below 8 are the prefixes' blocks
    assert shared.mean() == pytest.approx(0.5, abs=0.03)
    assert (df["prompt_tokens"][shared] > 1024).all()  # the prefix is added to the prompt
    firsts = {h[:2] for h, s in zip(ids, shared) if s}
    assert firsts == {(0, 1), (2, 3), (4, 5), (6, 7)}
    rest = [x for h, s in zip(ids, shared) for x in (h[2:] if s else h)]
    assert len(rest) == len(set(rest)) and min(rest) >= 8  # everything else is unique
    with pytest.raises(ValueError, match="hash_block_tokens"):
        synthetic_trace(shared_prefix={"num_prefixes": 2, "tokens": 100, "fraction": 1.0})


def test_changing_output_spec_leaves_arrivals_and_prompts_alone():
    a = synthetic_trace(seed=9)
    b = synthetic_trace(seed=9, output={"dist": "fixed", "value": 5})
    pd.testing.assert_series_equal(a["arrival_s"], b["arrival_s"])
    pd.testing.assert_series_equal(a["prompt_tokens"], b["prompt_tokens"])
