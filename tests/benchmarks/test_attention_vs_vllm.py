"""benchmarks/attention_vs_vllm.py: the inputs it makes, our side alone where vLLM's
environment is missing (saying why), an interrupted run writing the rounds it
measured, and both kernels giving the same outputs where it is set up."""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from testbed.vllm_backend import install
from tests.benchmarks.helpers import interrupt_after, run_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "attention_vs_vllm.py"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("attention_vs_vllm")


def test_each_key_has_its_own_slot_in_its_sequences_blocks(bench):
    t = bench.make_inputs([70, 33], [70, 1], torch.float32, seed=3)
    assert t["key"].shape[0] == t["value"].shape[0] == t["slots"].numel() == 103
    assert t["slots"].unique().numel() == 103  # no two keys share a slot
    blocks = t["slots"] // bench.BLOCK
    assert set(blocks[:70].tolist()) == set(t["tables"][0, :3].tolist())
    assert set(blocks[70:].tolist()) == set(t["tables"][1, :2].tolist())
    assert t["query"].shape[0] == 71 and t["starts"].tolist() == [0, 70, 71]
    assert not t["decode"]


def test_flops_count_the_keys_each_query_row_sees(bench):
    per_pair = bench.HEADS * 4 * bench.HEAD_DIM / 1e9
    assert bench.gflop([10], [1]) == pytest.approx(10 * per_pair)  # a decode: all 10
    assert bench.gflop([3], [3]) == pytest.approx((1 + 2 + 3) * per_pair)  # causal
    assert bench.gflop([5], [2]) == pytest.approx((4 + 5) * per_pair)  # a chunk after 3


def run(tmp_path: Path, env: dict | None = None) -> dict:
    return run_script(SCRIPT, tmp_path, "--rounds", "1", "--repeats", "1", env=env)


@pytest.mark.slow
def test_without_vllm_our_kernel_runs_alone_and_says_why(tmp_path):
    out = run(tmp_path, env={"TESTBED_VLLM_VENV": str(tmp_path / "none")})
    assert install.COMMAND in out["meta"]["vllm_skipped"] and install.COMMAND in out["stdout"]
    assert len(out["rows"]) == 12  # 6 shapes x 2 dtypes
    for row in out["rows"]:
        assert row["ours_ms"] > 0 and len(row["ours_ms_rounds"]) == 1
        assert "vllm_ms" not in row and "max_abs_diff" not in row


@pytest.mark.slow
@pytest.mark.skipif(not install.ready(), reason=f"vLLM's environment: {install.COMMAND}")
def test_both_kernels_give_the_same_attention(tmp_path):
    out = run(tmp_path)
    assert out["meta"]["vllm_skipped"] is None
    for row in out["rows"]:
        assert row["vllm_ms"] > 0 and row["ours_over_vllm"] > 0
        # float32: sums in another order; bfloat16: two steps of its 8-bit mantissa
        # at the largest output (each kernel rounds its weights and outputs)
        bound = 1e-4 if row["dtype"] == "float32" else 2 * 2**-7 * row["max_abs"]
        assert row["max_abs_diff"] <= bound, row


@pytest.mark.slow
def test_an_interrupted_run_writes_the_rounds_it_measured(tmp_path):
    out = tmp_path / "out.json"
    env = {**os.environ, "TESTBED_VLLM_VENV": str(tmp_path / "none")}
    cmd = [sys.executable, str(SCRIPT), "--rounds", "1000", "--repeats", "1", "--out", str(out)]
    status, rest = interrupt_after(cmd, "round 1: ours done", env)
    assert status == 130, rest[-3000:]
    result = json.loads(out.read_text())
    assert result["meta"]["interrupted"] is True
    assert all(len(row["ours_ms_rounds"]) >= 2 for row in result["rows"])
