"""A file that is not a trace (a binary, malformed JSON, a folder) fails with a
one-line TraceError naming the file and, where known, its line: for every trace
that reads a file, through load_trace, the run's trace and run.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from testbed.build import run_trace
from testbed.config_schema import compose_config
from testbed.errors import InputError
from testbed.models import PROJECT_ROOT
from tests.traces.conftest import SHARED_FILES
from traces import load_trace
from traces.loaders import load_azure, load_csv, load_lengths, load_mooncake
from traces.schema import TraceError
from traces.servegen import load_servegen

# An executable's first bytes: byte 24 (0xd0, then 0x0f) is not UTF-8, on line 1.
BINARY = b"\x7fELF\x02\x01\x01\x00" + bytes(16) + b"\xd0\x0f\x00\x00\x01\x02\n\x03"
NOT_UTF8 = r"line 1: not UTF-8 text \(byte 0xd0 at offset 24\)"
WINDOWS = "0,0.5,1.0,Gamma,1.0,2.0\n"  # one ServeGen window: 0.5 req/s from 0 s


def _error(call) -> str:
    with pytest.raises(TraceError) as info:
        call()
    msg = str(info.value)
    assert "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("loader", [load_csv, load_azure, load_lengths, load_mooncake])
def test_a_binary_file_names_the_file_and_the_line_of_its_first_bad_byte(tmp_path, loader):
    path = tmp_path / "ls"
    path.write_bytes(BINARY)
    msg = _error(lambda: loader(path))
    assert re.match(f"{re.escape(str(path))}, {NOT_UTF8}", msg), msg


@pytest.mark.parametrize("loader", [load_csv, load_azure, load_lengths, load_mooncake])
def test_a_bad_byte_further_down_names_its_line(tmp_path, loader):
    path = tmp_path / "t.txt"
    path.write_bytes(b"first line\nsecond\r\nthird \xff\n")
    assert ", line 3: not UTF-8 text (byte 0xff at offset 25)" in _error(lambda: loader(path))


@pytest.mark.parametrize("loader", [load_csv, load_azure, load_lengths, load_mooncake])
def test_a_folder_given_as_the_file_is_named(tmp_path, loader):
    msg = _error(lambda: loader(tmp_path))
    assert msg.startswith(f"{tmp_path}: cannot read it"), msg


def test_a_csv_parse_error_is_one_line_naming_the_file(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens\n0,1,1\n0,1,1,4,5\n")
    msg = _error(lambda: load_csv(path))
    assert msg.startswith(f"{path}: cannot parse as CSV") and "line 3" in msg


def _servegen_folder(tmp_path, windows: bytes, dataset: bytes | None):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "chunk-1-trace.csv").write_bytes(windows)
    if dataset is not None:
        (folder / "chunk-1-dataset.json").write_bytes(dataset)
    return folder


def test_servegen_binary_window_table_is_named(tmp_path):
    folder = _servegen_folder(tmp_path, BINARY, None)
    msg = _error(lambda: load_servegen(folder, duration_s=60.0))
    assert re.match(f"{re.escape(str(folder / 'chunk-1-trace.csv'))}, {NOT_UTF8}", msg), msg


@pytest.mark.parametrize(
    ("dataset", "where"),
    [
        (BINARY, ", line 1: not UTF-8 text"),
        (b'{"0": {"input_tokens": "{1: 1.0}",\n "output_tokens": }}', ", line 2: not valid JSON"),
        (b"[1, 2]", ": not a JSON object of windows"),
        (b'{"start": {"input_tokens": "{1: 1.0}"}}', ": window 'start' is not a number"),
        (b'{"0": [1]}', ": window '0' is not a JSON object"),
        (b'{"0": {"input_tokens": "[1]", "output_tokens": "{1: 1.0}"}}', "no readable distr"),
        (b'{"0": {"input_tokens": "{1: 1.0}", "output_tokens": "{1: \'x\'}"}}', "no readable"),
    ],
)
def test_servegen_bad_dataset_json_is_named(tmp_path, dataset, where):
    folder = _servegen_folder(tmp_path, WINDOWS.encode(), dataset)
    msg = _error(lambda: load_servegen(folder, duration_s=600.0, seed=1))
    assert msg.startswith(str(folder / "chunk-1-dataset.json")) and where in msg, msg


def test_servegen_binary_lengths_file_is_named(tmp_path):
    folder = _servegen_folder(tmp_path, WINDOWS.encode(), None)
    lengths = tmp_path / "lengths.bin"
    lengths.write_bytes(BINARY)
    msg = _error(lambda: load_servegen(folder, duration_s=600.0, lengths_from=lengths))
    assert msg.startswith(f"{lengths}, line 1: not UTF-8"), msg


@pytest.mark.parametrize("name", sorted(SHARED_FILES))
def test_every_shared_trace_names_a_binary_file_in_its_place(monkeypatch, tmp_path, name):
    """$TESTBED_TRACES_DIR pointing at a folder where the trace's file is a binary."""
    monkeypatch.setenv("TESTBED_TRACES_DIR", str(tmp_path))
    path = tmp_path / SHARED_FILES[name]
    if name.startswith("servegen_"):
        path.mkdir(parents=True)
        path = path / "chunk-0-trace.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(BINARY)
    assert str(path) in _error(lambda: load_trace(name))


def test_the_runs_trace_is_an_input_error_naming_the_file(tmp_path):
    path = tmp_path / "ls"
    path.write_bytes(BINARY)
    with pytest.raises(InputError, match=f"^trace=csv: {re.escape(str(path))}, {NOT_UTF8}"):
        run_trace(compose_config(["trace=csv", f"trace.path={path}"]))


def test_run_py_prints_it_on_one_line_and_exits_2(tmp_path):
    path = tmp_path / "ls"
    path.write_bytes(BINARY)
    cmd = [sys.executable, str(PROJECT_ROOT / "run.py"), "trace=csv", f"trace.path={path}"]
    cmd += ["mode=sim", "logging=disabled", f"hydra.run.dir={tmp_path / 'run'}"]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["TESTBED_NO_BOOTSTRAP"] = "1"
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: trace=csv: {path}, line 1: not UTF-8")
