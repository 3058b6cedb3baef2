"""Transforms: rate and time scaling, windows, head, sample, length caps; attrs and notes."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from traces.schema import make_trace
from traces.synthetic import synthetic_trace
from traces.transforms import (
    cap_lengths,
    head,
    mean_rate,
    sample,
    scale_time,
    scale_to_rate,
    window,
)


@pytest.fixture
def trace() -> pd.DataFrame:
    return make_trace(
        [0.0, 1.0, 2.0, 3.0, 4.0],
        [10, 5000, 20, 4096, 100],
        [5, 10, 4090, 1, 100],
        prefix_hash_ids=[
            (1,),
            (1, 2, 3, 4, 5, 6, 7, 8, 9, 10),
            (3,),
            (4, 5, 6, 7, 8, 9, 10, 11),
            None,
        ],
        name="t",
        source="test",
        hash_block_tokens=512,
        notes=["loaded"],
    )


def test_scale_to_rate_and_time(trace):
    assert mean_rate(trace) == 1.0
    fast = scale_to_rate(trace, 4.0)
    assert mean_rate(fast) == pytest.approx(4.0)
    assert fast["arrival_s"].tolist() == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert fast.attrs["notes"] == ["loaded", "rescaled arrivals from 1 to 4 req/s"]
    slow = scale_time(trace, 2.0)
    assert slow["arrival_s"].iloc[-1] == 8.0
    assert trace["arrival_s"].iloc[-1] == 4.0 and trace.attrs["notes"] == ["loaded"]  # untouched
    with pytest.raises(ValueError):
        scale_time(trace, 0.0)


def test_scale_to_rate_on_a_large_trace():
    df = synthetic_trace(num_requests=5000, rate=2.0)
    assert mean_rate(scale_to_rate(df, 7.5)) == pytest.approx(7.5)


def test_window_is_half_open_and_rezeroed(trace):
    w = window(trace, 1.0, 3.0)
    assert w["arrival_s"].tolist() == [0.0, 1.0]
    assert w["prompt_tokens"].tolist() == [5000, 20]
    assert list(w.index) == [0, 1]
    assert "window [1, 3) s: kept 2 of 5 requests" in w.attrs["notes"][-1]
    assert window(trace, 2.5)["arrival_s"].tolist() == [0.5, 1.5]  # to the end


def test_head_and_sample_keep_arrival_order(trace):
    assert head(trace, 2)["arrival_s"].tolist() == [0.0, 1.0]
    assert len(head(trace, 99)) == 5
    big = synthetic_trace(num_requests=1000)
    s = sample(big, 300, seed=1)
    assert len(s) == 300 and s["arrival_s"].is_monotonic_increasing
    assert set(s["arrival_s"]) <= set(big["arrival_s"])
    pd.testing.assert_frame_equal(s, sample(big, 300, seed=1))
    assert not s.equals(sample(big, 300, seed=2))
    assert len(sample(big, frac=0.25)) == 250
    assert s.attrs["notes"][-1] == "sampled 300 of 1000 requests, seed 1"
    with pytest.raises(ValueError):
        sample(big, 2000)


def test_cap_lengths_caps_notes_and_marks(trace):
    capped = cap_lengths(trace, 4096)
    assert capped["prompt_tokens"].tolist() == [10, 4095, 20, 4095, 100]
    assert capped["output_tokens"].tolist() == [5, 1, 4076, 1, 100]
    assert (capped["prompt_tokens"] + capped["output_tokens"] <= 4096).all()
    assert capped["capped"].tolist() == [False, True, True, True, False]
    assert capped.attrs["notes"][-1] == (
        "capped 3 requests at max_model_len=4096 (2 prompts, 2 outputs)"
    )
    # hash ids past the capped prompt are dropped: ceil(4095 / 512) = 8 blocks
    assert capped["prefix_hash_ids"].tolist()[1] == (1, 2, 3, 4, 5, 6, 7, 8)
    untouched = cap_lengths(trace, 100_000)
    assert "capped" not in untouched.columns
    assert untouched.attrs["notes"][-1].startswith("capped 0 requests")
    assert "capped" not in trace.columns


def test_transforms_keep_dtypes(trace):
    out = cap_lengths(window(scale_to_rate(trace, 2.0), 0.0, 10.0), 4096)
    for column in ("arrival_s", "prompt_tokens", "output_tokens", "priority"):
        assert out[column].dtype == trace[column].dtype
    assert out["capped"].dtype == np.bool_
    assert out.attrs["name"] == "t" and out.attrs["hash_block_tokens"] == 512


def test_scale_prompts_keeps_prefix_sharing_whole():
    from traces.transforms import scale_prompts

    df = make_trace(
        [0.0, 1.0],
        [1024, 600],
        [10, 10],
        prefix_hash_ids=[(1, 2), (1,)],
        name="t",
        source="test",
        hash_block_tokens=512,
    )
    out = scale_prompts(df, 0.0625)
    assert out["prompt_tokens"].tolist() == [64, 38]
    assert out.attrs["hash_block_tokens"] == 32
    assert out["prefix_hash_ids"].tolist() == [(1, 2), (1,)]
    assert "scaled prompt lengths by 0.0625" in out.attrs["notes"]
    with pytest.raises(ValueError, match="whole"):
        scale_prompts(df, 0.3)


def test_assigned_tenants_are_seeded_and_zipf_weighted_and_priorities_uniform():
    from traces.transforms import assign_priorities, assign_tenants

    n = 6000
    df = make_trace(np.arange(n) * 0.1, np.full(n, 10), np.full(n, 5), name="t", source="test")
    assert set(df["tenant"]) == {"default"} and set(df["priority"]) == {0}
    t = assign_tenants(df, 3, seed=7)
    counts = t["tenant"].value_counts(normalize=True)
    # Weights 1, 1/2, 1/3 over 11/6: t0 6/11, t1 3/11, t2 2/11.
    for name, share in (("t0", 6 / 11), ("t1", 3 / 11), ("t2", 2 / 11)):
        assert counts[name] == pytest.approx(share, abs=0.02)
    assert t["tenant"].equals(assign_tenants(df, 3, seed=7)["tenant"])
    assert not t["tenant"].equals(assign_tenants(df, 3, seed=8)["tenant"])
    assert "3 Zipf-weighted tenants, seed 7" in t.attrs["notes"][-1]
    assert set(df["tenant"]) == {"default"}  # the input is left alone
    p = assign_priorities(t, 4, seed=7)
    shares = p["priority"].value_counts(normalize=True)
    assert sorted(shares.index) == [0, 1, 2, 3] and (abs(shares - 0.25) < 0.02).all()
    assert p["tenant"].equals(t["tenant"])
    with pytest.raises(ValueError, match="tenants must be >= 1"):
        assign_tenants(df, 0)


def test_load_trace_assigns_tenants_and_priority_classes_by_option():
    from traces import load_trace

    df = load_trace("synthetic", num_requests=50, num_tenants=2, priority_classes=3, seed=1)
    assert set(df["tenant"]) <= {"t0", "t1"} and set(df["priority"]) <= {0, 1, 2}
    notes = " ".join(df.attrs["notes"])
    assert "replacing the trace's own" in notes  # synthetic traces have tenants


def test_slos_are_set_on_every_request_by_option_and_bad_ones_refused():
    from traces import load_trace
    from traces.transforms import assign_slos

    df = make_trace(np.arange(4) * 0.1, np.full(4, 10), np.full(4, 5), name="t", source="test")
    out = assign_slos(df, ttft_slo_s=0.5)
    assert (out["ttft_slo_s"] == 0.5).all() and out["tpot_slo_s"].isna().all()
    assert out.attrs["notes"][-1] == "ttft_slo_s 0.5 s"  # the trace had none of its own
    both = assign_slos(out, 1.0, 0.05)
    assert (both["ttft_slo_s"] == 1.0).all() and (both["tpot_slo_s"] == 0.05).all()
    assert "replacing the trace's own" in both.attrs["notes"][-2]
    with pytest.raises(ValueError, match="tpot_slo_s=0: must be > 0"):
        assign_slos(df, tpot_slo_s=0)
    loaded = load_trace("synthetic", num_requests=20, ttft_slo_s=2.0, tpot_slo_s=0.2)
    assert (loaded["ttft_slo_s"] == 2.0).all() and (loaded["tpot_slo_s"] == 0.2).all()
