"""benchmarks/engine_vs_vllm.py and its vLLM server: the profiler's forward-pass
split and vLLM's step shares on made-up numbers, and the script on its tiny
workload, our engine alone where vLLM's environment is missing (saying why) and
both engines where it is set up."""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from testbed.vllm_backend import install
from testbed.vllm_backend.offline import forward_split, op_part
from tests.benchmarks.helpers import interrupt_after, run_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "engine_vs_vllm.py"
TINY = ["--workloads", "tiny", "--dtypes", "float32", "--online-requests", "4"]


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # its own `from common import`
    return importlib.import_module("engine_vs_vllm")


def event(name: str, us: float, *children) -> SimpleNamespace:
    return SimpleNamespace(name=name, cpu_time_total=us, cpu_children=list(children))


def test_op_part_names_vllm_cpu_ops():
    assert op_part("_C::onednn_mm") == "linear"
    assert op_part("aten::addmm") == "linear"
    assert op_part("vllm::unified_attention_with_output") == "attention"
    assert op_part("_C::cpu_attn_reshape_and_cache") == "attention"
    assert op_part("vllm::unified_kv_cache_update") == "attention"
    assert op_part("_C::rms_norm") is None
    assert op_part("aten::mul") is None


def test_forward_split_counts_the_outermost_match_once():
    graph = event(
        "## Call CompiledFxGraph ##",
        900,
        event("_C::onednn_mm", 300),
        event("vllm::unified_attention_with_output", 200, event("_C::cpu_attention", 150)),
        event("_C::rms_norm", 50),
        event("_C::onednn_mm", 100),
    )
    events = [
        event("testbed_forward.decode", 1000, graph),
        event("testbed_forward.decode", 500, event("aten::mm", 100)),
        event("testbed_forward.prefill", 2000, event("aten::addmm", 1500)),
        event("_C::onednn_mm", 40),  # outside any forward pass: the LM head
    ]
    kinds, names = forward_split(events)
    assert kinds["decode"] == pytest.approx(
        {"forward": 1500e-6, "attention": 200e-6, "linear": 500e-6, "passes": 2}
    )
    assert kinds["prefill"]["linear"] == pytest.approx(1500e-6)
    assert names["_C::onednn_mm"] == pytest.approx(400e-6)
    assert "_C::cpu_attention" not in names  # inside the attention op, counted with it


def test_vllm_shares_compose_the_parts_of_each_step(bench):
    raw = {
        "seconds": {
            "decode": dict(step=10.0, execute=8.0, forward=6.0, logits=1.0, sample=1.0),
            "mixed": dict(step=4.0, execute=3.5, forward=3.0, logits=0.2, sample=0.1),
        },
        "steps": {"decode": 100, "mixed": 3},
        "forward_ops": {"decode": {"forward": 2.0, "attention": 0.5, "linear": 1.0, "passes": 9}},
        "op_seconds": {},
        "profiled_steps": 9,
    }
    summary, detail = bench.vllm_shares(raw)
    decode = summary["decode"]
    assert decode["attention"] == pytest.approx(6.0 * 0.25 / 10)
    assert decode["linear"] == pytest.approx(6.0 * 0.5 / 10)
    assert decode["prepare"] == pytest.approx((8.0 - 6.0 - 1.0) / 10)
    assert decode["lm_head_sampling"] == pytest.approx(2.0 / 10)
    assert decode["control_plane"] == pytest.approx((10.0 - 8.0 - 1.0) / 10)
    # No mixed step was profiled: its forward splits as the window's passes did.
    assert summary["mixed"]["linear"] == pytest.approx(3.0 * 0.5 / 4)
    for kind in ("all", "decode", "mixed"):
        assert sum(summary[kind][p] for p in bench.PARTS) == pytest.approx(1.0)
    assert summary["all"]["steps"] == 103
    assert detail["profiled_steps"] == 9


def run(tmp_path: Path, *args: str, env: dict | None = None) -> dict:
    return run_script(SCRIPT, tmp_path, *args, env=env)


def check_offline(row: dict, rounds: int) -> None:
    assert len(row["rounds_s"]) == len(row["rounds_tok_s"]) == rounds
    assert row["seconds"] > 0 and row["tok_s"] == pytest.approx(
        row["output_tokens"] / row["seconds"]
    )
    shares = row["breakdown"]["all"]
    assert shares["steps"] > 0
    assert sum(shares[p] for p in ("attention", "linear", "other_forward")) > 0.3
    assert len(row["other_load_cores_by_round"]) == rounds


def check_online(rows: list[dict], engines: set[str]) -> None:
    assert {r["engine"] for r in rows} == engines
    for dtype in {r["dtype"] for r in rows}:
        same = [r for r in rows if r["dtype"] == dtype]
        assert len({r["rate_req_s"] for r in same}) == 1  # the same arrivals for each
        slower = min(r["offline_capacity_req_s"] for r in same)  # in this precision
        for r in same:
            assert r["capacity_req_s"] == pytest.approx(slower)
            assert r["rate_req_s"] == pytest.approx(0.7 * r["capacity_req_s"])
    for r in rows:
        assert r["num_finished"] == r["requests"] == 4
        assert 0 < r["ttft_s_p50"] <= r["ttft_s_p99"]
        assert r["ttft_s_p50"] <= r["e2e_s_p50"]  # each request's TTFT is within its E2E


@pytest.mark.slow
def test_without_vllm_our_engine_runs_alone_and_says_why(tmp_path):
    out = run(tmp_path, *TINY, "--repeats", "2", env={"TESTBED_VLLM_VENV": str(tmp_path / "none")})
    assert install.COMMAND in out["meta"]["vllm_skipped"]
    assert install.COMMAND in out["stdout"]
    assert out["meta"]["environment"]["vllm"] == {"skipped": out["meta"]["vllm_skipped"]}
    offline = [r for r in out["rows"] if r["kind"] == "offline"]
    assert [r["engine"] for r in offline] == ["ours"]
    check_offline(offline[0], rounds=2)
    assert "vs_vllm" not in offline[0]
    online = [r for r in out["rows"] if r["kind"] == "online"]
    if out["meta"]["online_skipped"]:  # no shared traces on this machine
        assert "azure_conv" in out["meta"]["online_skipped"] and not online
    else:
        check_online(online, {"ours"})


def test_a_missing_trace_skips_the_online_part_by_name(bench, monkeypatch, tmp_path):
    monkeypatch.setenv("TESTBED_TRACES_DIR", str(tmp_path))
    why = bench.missing_trace(4)
    assert "azure_conv" in why and str(tmp_path) in why and "TESTBED_TRACES_DIR" in why


@pytest.mark.slow
def test_an_interrupted_run_writes_what_it_measured(tmp_path):
    out = tmp_path / "out.json"
    env = {**os.environ, "TESTBED_VLLM_VENV": str(tmp_path / "none")}
    cmd = [sys.executable, str(SCRIPT), *TINY, "--repeats", "1000", "--out", str(out)]
    status, rest = interrupt_after(cmd, "round 1 ", env)
    assert status == 130, rest[-3000:]
    result = json.loads(out.read_text())
    assert result["meta"]["interrupted"] is True
    (row,) = [r for r in result["rows"] if r["kind"] == "offline"]
    assert len(row["rounds_s"]) >= 2  # rounds 0 and 1 at least


@pytest.mark.slow
@pytest.mark.skipif(not install.ready(), reason=f"vLLM's environment: {install.COMMAND}")
def test_both_engines_on_the_same_weights(tmp_path):
    out = run(tmp_path, *TINY, "--repeats", "1")
    assert out["meta"]["vllm_skipped"] is None
    build = out["meta"]["environment"]["vllm"]["builds"]["float32"]
    assert build["build_s"] > 0 and build["threads"] >= 1
    if not out["meta"]["online_skipped"]:
        assert build["replay_engine_build_s"] > 0
    rows = {r["engine"]: r for r in out["rows"] if r["kind"] == "offline"}
    for row in rows.values():
        check_offline(row, rounds=1)
    ours, vllm = rows["ours"], rows["vllm"]
    assert ours["vs_vllm"] == pytest.approx(vllm["seconds"] / ours["seconds"])
    # float32 greedy decoding: the same weights give the same tokens in both.
    assert ours["same_greedy_outputs"] == ours["requests"]
    detail = vllm["breakdown_detail"]
    assert detail["profiled_steps"] > 0
    assert {op_part(name) for name in detail["op_seconds"]} == {"attention", "linear"}
    assert not math.isnan(vllm["breakdown"]["all"]["attention"])
    online = [r for r in out["rows"] if r["kind"] == "online"]
    if out["meta"]["online_skipped"]:
        assert "azure_conv" in out["meta"]["online_skipped"] and not online
    else:
        check_online(online, {"ours", "vllm"})
