"""Our CSV format: export then load gives back an identical trace."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from traces.export import export_csv
from traces.loaders import load_csv
from traces.schema import make_trace
from traces.synthetic import synthetic_trace
from traces.transforms import cap_lengths


def _round_trip(df: pd.DataFrame, path) -> pd.DataFrame:
    back = load_csv(export_csv(df, path))
    pd.testing.assert_frame_equal(back, df, check_exact=True)
    assert back.attrs == df.attrs
    return back


def test_round_trip_with_prefixes_nan_slos_and_capped(tmp_path):
    spec = {"num_prefixes": 3, "tokens": 1024, "fraction": 0.5}
    df = cap_lengths(synthetic_trace(shared_prefix=spec), 1500)
    assert df["ttft_slo_s"].isna().any() and "capped" in df.columns
    back = _round_trip(df, tmp_path / "t.csv")
    assert back["prefix_hash_ids"].iloc[0] == df["prefix_hash_ids"].iloc[0]


def test_round_trip_without_prefixes(tmp_path):
    _round_trip(synthetic_trace(num_requests=50, seed=4), tmp_path / "t.csv")


def test_hand_written_file_with_defaults(tmp_path):
    path = tmp_path / "mine.csv"
    path.write_text(
        "# a free comment\n# name: mine\n"
        "arrival_s,prompt_tokens,output_tokens,tenant,ttft_slo_s,prefix_hash_ids\n"
        "0,10,5,,,\n"
        "\n"
        "0.5,20,6,NA,1.5,1 2\n"
    )
    df = load_csv(path)
    assert df.attrs == {"name": "mine", "source": str(path), "hash_block_tokens": 512, "notes": []}
    assert df["tenant"].tolist() == ["default", "NA"]  # only an empty cell means "none"
    assert df["priority"].tolist() == [0, 0]
    assert math.isnan(df["ttft_slo_s"].iloc[0]) and df["ttft_slo_s"].iloc[1] == 1.5
    assert df["tpot_slo_s"].isna().all()
    assert df["prefix_hash_ids"].tolist() == [None, (1, 2)]
    assert "capped" not in df.columns


def test_capped_column_with_empty_cells(tmp_path):
    path = tmp_path / "c.csv"
    path.write_text(
        "arrival_s,prompt_tokens,output_tokens,capped\n0,1,1,True\n1,1,1,\n2,1,1,False\n"
    )
    assert load_csv(path)["capped"].tolist() == [True, False, False]


floats = st.floats(min_value=1e-9, max_value=1e6, allow_nan=False, allow_infinity=False)


@st.composite
def traces(draw) -> pd.DataFrame:
    n = draw(st.integers(1, 20))
    arrival = sorted(draw(st.lists(st.floats(0, 1e7), min_size=n, max_size=n)))
    ints = st.integers(1, 10**9)
    slo = st.one_of(st.just(math.nan), floats)
    tenant = st.text(st.sampled_from("ab ,\"'#xyz-_"), min_size=1, max_size=8)
    ids = st.one_of(st.none(), st.lists(st.integers(0, 2**62), min_size=1).map(tuple))
    return make_trace(
        arrival,
        draw(st.lists(ints, min_size=n, max_size=n)),
        draw(st.lists(ints, min_size=n, max_size=n)),
        tenant=draw(st.lists(tenant, min_size=n, max_size=n)),
        priority=draw(st.lists(st.integers(-5, 5), min_size=n, max_size=n)),
        ttft_slo_s=draw(st.lists(slo, min_size=n, max_size=n)),
        tpot_slo_s=draw(st.lists(slo, min_size=n, max_size=n)),
        prefix_hash_ids=draw(st.lists(ids, min_size=n, max_size=n)),
        name=draw(st.text(st.sampled_from("abc: #"), max_size=6)).strip() or "x",
        source="hypothesis",
        notes=draw(st.lists(st.text(st.sampled_from("abc ,:"), max_size=10).map(str.strip))),
    )


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(df=traces())
def test_round_trip_property(tmp_path, df):
    _round_trip(df, tmp_path / "h.csv")
    assert np.array_equal(df["arrival_s"], load_csv(tmp_path / "h.csv")["arrival_s"])
