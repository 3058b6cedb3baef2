"""Per-tenant metrics and Jain's fairness index, from hand-made request records."""

import math

import numpy as np
import pandas as pd
import pytest

from testbed.metrics.summary import _jain, per_tenant


def records() -> pd.DataFrame:
    # tenant a: two finished (one within its SLOs); tenant b: one finished, one rejected
    return pd.DataFrame({
        "tenant": ["a", "a", "b", "b"],
        "status": ["finished_stopped", "finished_length", "finished_stopped", "rejected"],
        "prompt_tokens": [10, 30, 20, 40],
        "output_tokens": [5, 5, 10, 10],
        "ttft_s": [0.1, 0.5, 0.2, np.nan],
        "tpot_s": [0.01, 0.03, 0.02, np.nan],
        "e2e_s": [1.0, 2.0, 3.0, np.nan],
    })  # fmt: skip


def test_each_tenant_gets_its_own_latencies_tokens_and_attainment():
    df = records()
    done = df[df["status"] != "rejected"]
    met = pd.Series([True, False, True], index=done.index)
    stats = per_tenant(df, done, met)
    assert set(stats) == {"a", "b"}
    a, b = stats["a"], stats["b"]
    assert (a["num_requests"], a["num_finished"], b["num_finished"]) == (2, 2, 1)
    assert a["ttft_s_mean"] == pytest.approx(0.3) and b["ttft_s_mean"] == pytest.approx(0.2)
    assert a["e2e_s_mean"] == pytest.approx(1.5) and b["tpot_s_mean"] == pytest.approx(0.02)
    assert (a["asked_tokens"], a["served_tokens"]) == (50, 50)
    assert (b["asked_tokens"], b["served_tokens"]) == (80, 30)
    assert b["service_share"] == pytest.approx(30 / 80)
    assert a["slo_attainment"] == 0.5 and b["slo_attainment"] == 0.5


def test_a_tenant_with_nothing_finished_has_no_latencies_and_no_service():
    df = records()
    done = df[df["tenant"] == "a"]
    stats = per_tenant(df, done, pd.Series(True, index=done.index))
    assert stats["b"]["num_finished"] == 0 and math.isnan(stats["b"]["ttft_s_mean"])
    assert stats["b"]["service_share"] == 0 and stats["b"]["slo_attainment"] == 0


def test_jain_is_one_for_equal_shares_and_one_over_n_for_one_tenant_served():
    assert _jain(np.array([0.5, 0.5, 0.5])) == pytest.approx(1.0)
    assert _jain(np.array([1.0, 0.0, 0.0, 0.0])) == pytest.approx(0.25)
    assert _jain(np.array([1.0, 30 / 80])) == pytest.approx((1 + 0.375) ** 2 / (2 * (1 + 0.375**2)))


def test_ttft_jain_sees_one_tenant_kept_waiting_where_service_jain_cannot(tmp_path):
    from tests.sim.helpers import run

    m = run(tmp_path, "trace.num_requests=40")
    ttft = [t["ttft_s_mean"] for t in m["per_tenant"].values()]
    inv = np.array([1 / t for t in ttft])
    assert m["tenant_ttft_jain"] == pytest.approx(inv.sum() ** 2 / (len(inv) * (inv**2).sum()))
    assert m["tenant_service_jain"] == 1.0  # every request served in the end


def test_the_backlog_trend_tells_a_growing_queue_from_a_steady_one():
    from testbed.metrics.summary import backlog_trend

    arrivals = np.arange(100.0)
    # Steady: every request takes 3 s (three in the engine at any time).
    steady = pd.DataFrame({"arrival_s": arrivals, "finish_s": arrivals + 3.0})
    growth, spread = backlog_trend(steady, 25.0, 99.0)
    assert abs(growth) < 1e-9 and spread < 1e-9
    # Growing: one request in two finishes; the other never does (50 more by the end).
    growing = steady.assign(finish_s=np.where(arrivals % 2 == 0, arrivals + 1.0, np.nan))
    growth, spread = backlog_trend(growing, 25.0, 99.0)
    assert growth == pytest.approx(37, abs=1.0) and spread < 1.0
