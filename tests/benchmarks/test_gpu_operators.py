"""benchmarks/gpu_operators.py without a GPU: its predictions and comparison on fake
measurements, its whole flow with the measuring faked, and its refusal on a CPU."""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_operators.py"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # its own `from common import`
    return importlib.import_module("gpu_operators")


def fake(bench, steps, factors, tokens=(1, 64, 4096)):
    """Measurements at ``factors[op]`` times what the model predicts, decode attention
    included (one batch at one context)."""
    out = []
    for model, step in steps.items():
        for t in tokens:
            for op in bench.OPS:
                probe = bench.Measured(model, op, t, 1.0)
                out.append(replace(probe, seconds=factors[op] * bench.predict(step, probe)[0]))
        probe = bench.Measured(model, bench.ATTENTION, 16, 1.0, context=1024)
        seconds = factors[bench.ATTENTION] * bench.predict(step, probe)[0]
        out.append(bench.Measured(model, bench.ATTENTION, 16, seconds, context=1024))
    return out


def test_ratios_and_summary_follow_the_measurements(bench):
    steps, note = bench.predictors(list(bench.MODELS), "h100")
    assert set(steps) == set(bench.MODELS) and "h100" in note and "scaled" not in note
    # the benchmark's premise: one shape read from a measured table, one fitted
    assert bench.op_source(steps["llama2-7b"]) == "table"
    assert bench.op_source(steps["llama3-8b"]) == "fitted"
    factors = {op: 1.0 + 0.1 * i for i, op in enumerate((*bench.OPS, bench.ATTENTION))}
    measured = fake(bench, steps, factors)
    # one op twice as slow at one point only: the worst ratio, not the median
    doubled = ("llama3-8b", "add", 4096)
    i = next(j for j, m in enumerate(measured) if (m.model, m.op, m.tokens) == doubled)
    measured[i] = replace(measured[i], seconds=2 * measured[i].seconds)
    rows = bench.compare(measured, steps)
    assert len(rows) == len(measured)
    for r in rows:
        assert r["predicted"] > 0 and r["seconds"] > 0
        want = factors[r["op"]] * (2 if (r["model"], r["op"], r["tokens"]) == doubled else 1)
        assert r["ratio"] == pytest.approx(want)
        kind = "figures" if r["op"] == bench.ATTENTION else bench.op_source(steps[r["model"]])
        assert r["source"] == kind
    summary = {(s["op"], s["source"]): s for s in bench.summarize(rows)}
    assert set(summary) == {(op, kind) for op in bench.OPS for kind in ("table", "fitted")} | {
        (bench.ATTENTION, "figures")
    }
    for (op, _), s in summary.items():
        assert s["median_ratio"] == pytest.approx(factors[op])
        assert s["n"] == (2 if op == bench.ATTENTION else 3)  # two models; three token counts
    add = summary[("add", "fitted")]
    assert add["worst_ratio"] == pytest.approx(2 * factors["add"])
    assert add["worst_at"] == "llama3-8b 4096"


def test_a_sibling_gpu_is_labelled_and_scaled(bench):
    h100, _ = bench.predictors(["llama2-7b"], "h100")
    h200, note = bench.predictors(["llama2-7b"], "h200")
    assert "h100's operators scaled" in note
    assert bench.op_source(h200["llama2-7b"]) == "table, h100 scaled"
    # the H200's faster memory and equal compute: faster few tokens, as fast many
    few, many = (bench.Measured("llama2-7b", "mlp_down", t, 1.0) for t in (16, 4096))
    assert bench.predict(h200["llama2-7b"], few)[0] < bench.predict(h100["llama2-7b"], few)[0]
    assert bench.predict(h200["llama2-7b"], many)[0] == bench.predict(h100["llama2-7b"], many)[0]
    rows = bench.compare([bench.Measured("llama2-7b", "qkv", 16, 1e-5)], h200)
    assert bench.summarize(rows)[0]["source"] == "table"


def test_without_predictions_the_rows_keep_their_measurements(bench):
    steps, note = bench.predictors(["llama2-7b"], None)
    assert steps == {} and "no conf/hardware entry" in note
    steps, note = bench.predictors(["llama2-7b"], "cpu")  # an entry with no operator data
    assert steps == {} and "no predictions" in note
    nbytes = 3 * 16 * 4096 * 2
    rows = bench.compare([bench.Measured("llama2-7b", "add", 16, 2e-6, bytes=nbytes)], {})
    assert rows[0]["ratio"] is None and rows[0]["gb_s"] == pytest.approx(nbytes / 2e-6 / 1e9)
    assert bench.summarize(rows) == []
    bench.print_table(rows, [])
    step = bench.predictors(["llama2-7b"], "h100")[0]["llama2-7b"]
    with pytest.raises(ValueError, match="unknown op 'nope'"):
        bench.predict(step, bench.Measured("llama2-7b", "nope", 1, 1.0))


def test_the_whole_flow_with_fake_measurements(bench, monkeypatch, tmp_path, capsys):
    """main() as on an H100, its measuring replaced: the table, the summary and a JSON
    file with the environment and no absolute path."""
    steps, _ = bench.predictors(list(bench.MODELS), "h100")
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench.torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")

    def layer_ops(model, tokens, repeats):
        probes = [bench.Measured(model, op, t, 1.0) for t in tokens for op in bench.OPS]
        return [replace(p, seconds=1.5 * bench.predict(steps[model], p)[0]) for p in probes]

    monkeypatch.setattr(bench, "measure_layer_ops", layer_ops)
    monkeypatch.setattr(bench, "measure_decode_attention", lambda *a: [])
    bench.main(["--out", str(tmp_path / "res"), "--tokens", "1", "256"])
    text = capsys.readouterr().out
    assert "mlp_up" in text and "median" in text
    written = tmp_path / "res" / "gpu_operators.json"
    obj = json.loads(written.read_text())
    meta, rows = obj["meta"], obj["rows"]
    assert meta["device"] == "NVIDIA H100 80GB HBM3" and meta["hardware"] == "h100"
    assert {"torch", "cuda", "date"} <= set(meta) and meta["stopped"] is False
    assert len(rows) == 2 * 2 * len(bench.OPS)
    assert all(math.isclose(r["ratio"], 1.5) for r in rows)
    assert str(tmp_path) not in written.read_text() and str(ROOT) not in written.read_text()


def test_a_stop_writes_what_was_measured(bench, monkeypatch, tmp_path):
    """SIGTERM (the GPU check's step limit) part-way: the rows measured so far, marked."""
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench.torch.cuda, "get_device_name", lambda *a: "Some GPU")

    def layer_ops(model, tokens, repeats):
        yield bench.Measured(model, "qkv", tokens[0], 1e-5)
        yield bench.Measured(model, "o", tokens[0], 1e-5)
        raise bench.Stopped

    monkeypatch.setattr(bench, "measure_layer_ops", layer_ops)
    bench.main(["--out", str(tmp_path / "r.json"), "--tokens", "16"])
    obj = json.loads((tmp_path / "r.json").read_text())
    assert obj["meta"]["stopped"] is True and obj["meta"]["hardware"] is None
    assert [(r["op"], r["ratio"]) for r in obj["rows"]] == [("qkv", None), ("o", None)]


def test_without_cuda_it_says_so_and_exits_cleanly(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(SCRIPT), "--out", str(tmp_path / "x")]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "gpu_operators needs a CUDA device: nothing measured"
    assert not (tmp_path / "x").exists()
