"""Loaders on the real shared data (skipped, naming the path, where it is absent)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from traces.loaders import load_azure, load_lengths, load_mooncake
from traces.schema import COLUMNS
from traces.servegen import load_servegen

AZURE = "azure_llm_2023/AzureLLMInferenceTrace_{}.csv"
SARATHI = "length_dists_sarathi/"


def _is_trace(df: pd.DataFrame) -> None:
    assert list(df.columns) == list(COLUMNS)
    assert {c: str(t) for c, t in df.dtypes.items()} == COLUMNS
    assert df["arrival_s"].iloc[0] == 0.0 and df["arrival_s"].is_monotonic_increasing
    assert (df["prompt_tokens"] > 0).all() and (df["output_tokens"] > 0).all()


@pytest.mark.parametrize(
    ("kind", "rows", "prompt_mean", "output_mean", "span_s"),
    [("conv", 19_366, 1155, 211, 3502), ("code", 8_819, 2048, 28, 3436)],
)
def test_azure(shared, kind, rows, prompt_mean, output_mean, span_s):
    df = load_azure(shared(AZURE.format(kind)))
    _is_trace(df)
    assert len(df) == rows  # the README's numbers
    assert round(df["prompt_tokens"].mean()) == prompt_mean
    assert round(df["output_tokens"].mean()) == output_mean
    assert round(df["arrival_s"].iloc[-1]) == span_s
    # 7 fractional digits: the second request is 4.3145790 s after the first
    if kind == "conv":
        assert df["arrival_s"].iloc[1] == pytest.approx(4.314579, abs=1e-7)


def test_mooncake_conversation_keep(shared):
    df = load_mooncake(shared("mooncake/conversation_trace.jsonl"))
    _is_trace(df)
    assert len(df) == 12_031 and df.attrs["hash_block_tokens"] == 512
    lengths = df["prefix_hash_ids"].map(len)
    assert (lengths == np.ceil(df["prompt_tokens"] / 512)).all()
    assert df["arrival_s"].nunique() == 1_180  # the 3-second buckets
    assert round(df["prompt_tokens"].mean()) == 12_035


def test_mooncake_conversation_uniform_spread(shared):
    path = shared("mooncake/conversation_trace.jsonl")
    keep = load_mooncake(path)
    spread = load_mooncake(path, spread="uniform", seed=1)
    _is_trace(spread)
    assert len(spread) == len(keep)
    for column in ("prompt_tokens", "output_tokens", "prefix_hash_ids"):
        pd.testing.assert_series_equal(spread[column], keep[column])  # same order
    assert spread["arrival_s"].nunique() > 12_000
    # every request stays within its 3-second bucket (up to the re-zeroing shift)
    shift = spread["arrival_s"] - keep["arrival_s"]
    assert shift.min() > -1.0 and shift.max() < 3.01
    pd.testing.assert_frame_equal(spread, load_mooncake(path, spread="uniform", seed=1))
    assert "spread" in spread.attrs["notes"][-1]


def test_mooncake_synthetic(shared):
    df = load_mooncake(shared("mooncake/synthetic_trace.jsonl"))
    _is_trace(df)
    assert len(df) == 3_993 and round(df["output_tokens"].mean()) == 149


@pytest.mark.parametrize(
    ("name", "rows"),
    [
        ("sharegpt_8k_filtered_stats_llama2_tokenizer.csv", 30_731),
        ("arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv", 28_257),
        ("bwb_stats_llama2_tokenizer_filtered_v2.csv", 33_768),
    ],
)
def test_length_files(shared, name, rows):
    path = shared(SARATHI + name)
    df = load_lengths(path, rate=4.0)
    _is_trace(df)
    assert len(df) == rows
    assert (rows - 1) / df["arrival_s"].iloc[-1] == pytest.approx(4.0, rel=0.05)
    raw = pd.read_csv(path)
    assert (df["prompt_tokens"].to_numpy() == raw["num_prefill_tokens"].to_numpy()).all()


def test_length_file_sampling(shared):
    path = shared(SARATHI + "sharegpt_8k_filtered_stats_llama2_tokenizer.csv")
    few = load_lengths(path, num_requests=100, seed=3)
    assert len(few) == 100 and "without replacement" in few.attrs["notes"][0]
    pd.testing.assert_frame_equal(few, load_lengths(path, num_requests=100, seed=3))
    many = load_lengths(path, num_requests=40_000, arrival="gamma", cv=2.0)
    assert len(many) == 40_000 and "with replacement" in many.attrs["notes"][0]


def test_servegen_deepseek_rate_and_lengths(shared):
    folder = shared("servegen/reason/deepseek-r1")
    df = load_servegen(folder, duration_s=600.0)
    assert list(df.columns) == list(COLUMNS) and df["arrival_s"].is_monotonic_increasing
    assert df["arrival_s"].between(0, 600).all()  # relative to start_s, not to the first
    # the expected count is the sum of the clients' rates in window 0, times 600 s
    expected = sum(
        pd.read_csv(p, header=None).iloc[0, 1] * 600 for p in folder.glob("chunk-*-trace.csv")
    )
    assert abs(len(df) - expected) <= 73  # one random rounding per client
    assert 4.0 < len(df) / 600 < 45.0  # README: 4.3 to 42.5 req/s over the day
    assert df["tenant"].str.startswith("chunk-").all()
    assert 100 < df["prompt_tokens"].mean() < 10_000
    pd.testing.assert_frame_equal(df, load_servegen(folder, duration_s=600.0))


def test_servegen_max_clients_keeps_the_others_unchanged(shared):
    folder = shared("servegen/reason/deepseek-r1")
    full = load_servegen(folder, duration_s=600.0, seed=2)
    top = load_servegen(folder, duration_s=600.0, seed=2, max_clients=3)
    assert top["tenant"].nunique() <= 3
    for tenant, rows in top.groupby("tenant"):
        expected = full[full["tenant"] == tenant].reset_index(drop=True)
        pd.testing.assert_frame_equal(rows.reset_index(drop=True), expected, check_like=True)


def test_servegen_mm_image_and_language(shared):
    mm = load_servegen(shared("servegen/multimodal/mm-image"), duration_s=300.0, start_s=3600.0)
    assert len(mm) > 0 and mm["arrival_s"].between(0, 300).all()
    assert mm["prompt_tokens"].mean() > 500  # text plus ~1.6 images of ~650 tokens
    folder = shared("servegen/language/m-large")
    with pytest.raises(ValueError, match="arrival statistics only"):
        load_servegen(folder, duration_s=60.0)
    lengths = shared(SARATHI + "bwb_stats_llama2_tokenizer_filtered_v2.csv")
    lang = load_servegen(folder, duration_s=60.0, lengths_from=lengths)
    assert len(lang) > 0 and math.isclose(lang["prompt_tokens"].mean(), 1067, rel_tol=0.1)
