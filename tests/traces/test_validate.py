"""Bad input fails with a TraceError that names the file, the row and the field."""

from __future__ import annotations

import re

import pandas as pd
import pytest

from traces.loaders import load_azure, load_csv, load_lengths, load_mooncake
from traces.schema import TraceError
from traces.validate import validate

HEADER = "arrival_s,prompt_tokens,output_tokens,ttft_slo_s\n"
GOOD = "0.0,10,5,\n0.5,20,6,1.0\n"


def _error(loader, path) -> str:
    with pytest.raises(TraceError) as info:
        loader(path)
    return str(info.value)


def _assert_names(msg: str, path, row: str, field: str) -> None:
    assert str(path) in msg, msg
    assert row in msg, msg
    assert f"field '{field}'" in msg, msg


@pytest.mark.parametrize(
    ("bad_row", "field", "problem"),
    [
        ("1.0,abc,5,", "prompt_tokens", "not a number ('abc')"),
        ("1.0,0,5,", "prompt_tokens", "must be > 0 (got 0)"),
        ("1.0,10,-3,", "output_tokens", "must be > 0 (got -3)"),
        ("1.0,10.5,3,", "prompt_tokens", "not a whole number"),
        ("0.2,10,5,", "arrival_s", "must be non-decreasing"),
        (",10,5,", "arrival_s", "missing value"),
        ("1.0,nan,5,", "prompt_tokens", "missing value"),
        ("1.0,10,5,0", "ttft_slo_s", "must be > 0 when given"),
        ("1.0,10,5,inf", "ttft_slo_s", "not a finite number"),
    ],
)
def test_csv_bad_row(tmp_path, bad_row, field, problem):
    path = tmp_path / "bad.csv"
    path.write_text("# name: bad\n" + HEADER + GOOD + bad_row + "\n")
    msg = _error(load_csv, path)
    # data row 3; the file's line 5 (after a comment line and the header)
    _assert_names(msg, path, "row 3 (line 5)", field)
    assert problem in msg


def test_csv_missing_and_unknown_columns(tmp_path):
    path = tmp_path / "nocol.csv"
    path.write_text("arrival_s,output_tokens\n0,5\n")
    msg = _error(load_csv, path)
    _assert_names(msg, path, "header (line 1)", "prompt_tokens")
    assert "missing column" in msg
    path.write_text("arrival_s,prompt_tokens,output_tokens,ttft_slo\n0,5,5,1\n")
    assert "unknown column" in _error(load_csv, path)


def test_csv_bad_prefix_ids_and_blank_lines_keep_line_numbers(tmp_path):
    path = tmp_path / "ids.csv"
    path.write_text(
        "arrival_s,prompt_tokens,output_tokens,prefix_hash_ids\n0,1,1,1 2\n\n1,1,1,3 x\n"
    )
    msg = _error(load_csv, path)
    _assert_names(msg, path, "row 2 (line 4)", "prefix_hash_ids")


def test_azure_bad_rows_use_the_files_field_names(tmp_path):
    path = tmp_path / "azure.csv"
    head = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
    path.write_text(head + "2023-11-16 18:15:50.9951690,0,109\n")
    _assert_names(_error(load_azure, path), path, "row 2 (line 3)", "ContextTokens")
    path.write_text(head + "yesterday,10,109\n")
    _assert_names(_error(load_azure, path), path, "row 2 (line 3)", "TIMESTAMP")
    path.write_text(head + "2023-11-16 18:15:40.0000000,10,109\n")
    msg = _error(load_azure, path)
    _assert_names(msg, path, "row 2 (line 3)", "TIMESTAMP")
    assert "non-decreasing" in msg
    path.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.6805900,374\n")
    _assert_names(_error(load_azure, path), path, "header", "GeneratedTokens")


def test_mooncake_malformed_json_and_bad_values(tmp_path):
    path = tmp_path / "m.jsonl"
    good = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n'
    path.write_text(good + '{"timestamp": 3000, "input_length": 7\n')
    msg = _error(load_mooncake, path)
    assert str(path) in msg and re.search(r"row 2\b", msg) and "not valid JSON" in msg
    path.write_text(good + '{"timestamp": 3000, "input_length": 7, "output_length": "x"}\n')
    _assert_names(_error(load_mooncake, path), path, "row 2", "output_length")
    path.write_text(good + '{"timestamp": 3000, "input_length": 7, "output_length": 1}\n')
    assert len(load_mooncake(path)) == 2  # hash_ids are optional
    path.write_text(good + '{"input_length": 7, "output_length": 1}\n')
    _assert_names(_error(load_mooncake, path), path, "row 2", "timestamp")


def test_lengths_file_bad_row(tmp_path):
    path = tmp_path / "l.csv"
    path.write_text("num_prefill_tokens,num_decode_tokens\n5,6\n7,-1\n")
    _assert_names(_error(load_lengths, path), path, "row 2 (line 3)", "num_decode_tokens")


def test_validate_on_a_frame_converts_types():
    raw = pd.DataFrame(
        {"arrival_s": ["0", "1.5"], "prompt_tokens": ["3", "4"], "output_tokens": [1, 2]}
    )
    df = validate(raw, "frame")
    assert df["prompt_tokens"].dtype == "int64" and df["arrival_s"].tolist() == [0.0, 1.5]
    assert df.attrs["source"] == "frame" and df["tenant"].tolist() == ["default"] * 2
    with pytest.raises(TraceError, match="frame, row 2, field 'arrival_s'"):
        validate(
            pd.DataFrame({"arrival_s": [1, 0], "prompt_tokens": [1, 1], "output_tokens": [1, 1]}),
            "frame",
            header_lines=0,  # a frame, not a file: no header line to count
        )
