"""load_trace: every config name dispatches, options are checked, files are found."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

import traces
from tests.traces.conftest import SHARED_FILES as _FILES
from traces import TRACE_NAMES, load_trace, traces_dir
from traces.export import export_csv
from traces.synthetic import synthetic_trace


@pytest.mark.parametrize("name", TRACE_NAMES)
def test_every_name_loads(name, shared, tmp_path):
    options: dict = {"max_model_len": 4096}
    if name == "csv":
        options["path"] = export_csv(synthetic_trace(num_requests=20), tmp_path / "t.csv")
    elif name == "concurrency":
        options["max_concurrency"] = 4
    elif name != "synthetic":
        shared(_FILES[name])
        if name.startswith("servegen_"):
            options["duration_s"] = 60.0  # m-mid alone runs at ~1,000 req/s
        if name in ("servegen_m-large", "servegen_m-mid", "servegen_m-small"):
            options["lengths_from"] = "sharegpt"
            shared(_FILES["sharegpt"])
    df = load_trace(name, **options)
    assert len(df) > 0 and df.attrs["name"] == name
    assert (df["prompt_tokens"] + df["output_tokens"] <= 4096).all()
    assert df.attrs["notes"][-1].startswith("capped")


def test_every_name_is_covered():
    assert set(TRACE_NAMES) == {*_FILES, "synthetic", "csv", "concurrency"}


def test_generic_options_apply_in_documented_order(shared):
    shared(_FILES["azure_conv"])
    df = load_trace(
        "azure_conv",
        window_start_s=60.0,
        window_end_s=660.0,
        num_requests=1000,
        sample=500,
        seed=3,
        rate=2.0,
        time_scale=0.5,
        max_model_len=2048,
    )
    notes = df.attrs["notes"]
    assert [n.split()[0] for n in notes] == [
        "window",
        "kept",
        "sampled",
        "rescaled",
        "scaled",
        "capped",
    ]
    assert "seed 3" in notes[2] and len(df) == 500
    assert (len(df) - 1) / (df["arrival_s"].iloc[-1] - df["arrival_s"].iloc[0]) == pytest.approx(
        4.0
    )


def test_loader_options_take_precedence_and_none_means_unset():
    df = load_trace("synthetic", num_requests=50, rate=5.0, seed=1, window_end_s=None)
    assert len(df) == 50 and not any(n.startswith("kept") for n in df.attrs["notes"])
    pd.testing.assert_frame_equal(df, synthetic_trace(num_requests=50, rate=5.0, seed=1))


def test_unknown_options_and_names_are_errors(tmp_path):
    with pytest.raises(ValueError, match=r"unknown options \['spreed'\]"):
        load_trace("synthetic", spreed="uniform")
    with pytest.raises(ValueError, match="unknown trace 'azure'"):
        load_trace("azure")
    with pytest.raises(ValueError, match="needs a path"):
        load_trace("csv")


def test_traces_dir_default_and_env(monkeypatch, tmp_path):
    monkeypatch.delenv("TESTBED_TRACES_DIR", raising=False)
    root = Path(traces.__file__).resolve().parents[2]
    assert traces_dir() == root / "shared" / "traces"
    monkeypatch.setenv("TESTBED_TRACES_DIR", str(tmp_path))
    assert traces_dir() == tmp_path
    with pytest.raises(FileNotFoundError) as info:
        load_trace("azure_conv")
    msg = str(info.value)
    assert "AzureLLMInferenceTrace_conv.csv" in msg and str(tmp_path) in msg
    assert "TESTBED_TRACES_DIR" in msg
