"""Per-layer operator times: measured tables where one matches, the fitted curve elsewhere."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from testbed.sim.operators import OPS, LayerShape, OperatorTimes, gpus

ROOT = Path(__file__).resolve().parents[2]
SHAPE = LayerShape(hidden=64, intermediate=256, num_heads=8, num_kv_heads=2, head_dim=8)
GEMM = {
    "t0_mem_s": 2e-6,
    "t0_compute_s": 5e-6,
    "flops_max": 1e14,
    "m_half": 50.0,
    "bytes_per_s": 1e12,
}
ELEM = {"t0_s": 1e-6, "elements_per_s": 1e11, "q": 2.0}
KINDS = ("norm", "act", "add", "rope", "emb", "pooled")


def knots(tokens, ms, tail=0.001):
    return {"tokens": tokens, "ms": ms, "tail": tail}


def table(model="org/tiny", shape=SHAPE, tps=(1, 2), top=64, skip=()):
    """A table whose every op reads 0.01 ms at 1 token and ``scale`` ms at ``top``."""
    per_tp = {}
    for tp in tps:
        ops = {}
        for i, op in enumerate((*OPS, "emb")):
            if op in skip:
                continue
            scale = 0.1 * (i + 1) / tp
            ops[op] = knots([1, 16, top], [0.01, scale / 2, scale])
        per_tp[str(tp)] = ops
    return {
        "model": model,
        "shape": vars(shape),
        "vocab_size": 1000,
        "num_tokens": [1, top],
        "tp": per_tp,
    }


def write(folder: Path, gpu="x100", tables=None, gemm=None, without=None) -> Path:
    gemm = gemm or GEMM
    fit = {"gemm": gemm, "elementwise": {k: ELEM for k in KINDS}}
    tables = tables if tables is not None else [table()]
    without = without or {t["model"]: fit for t in tables}
    obj = {"gpu": gpu, "source": {"commit": "abc"}, "fit": fit, "fit_without": without}
    obj["tables"] = tables
    (folder / f"operators_{gpu}.json").write_text(json.dumps(obj))
    return folder


def gemm_formula(m, k, n, p=GEMM, dtype_bytes=2):
    compute = 2 * m * k * n * (m + p["m_half"]) / (p["flops_max"] * m)
    memory = dtype_bytes * (m * k + k * n + m * n) / p["bytes_per_s"]
    return max(p["t0_mem_s"] + memory, p["t0_compute_s"] + compute)


def test_measured_table_interpolates_and_extrapolates(tmp_path):
    layer = OperatorTimes.load("x100", write(tmp_path)).layer(SHAPE, 2)
    assert layer.measured and layer.source == "measured: org/tiny (vidur x100 abc, tp=2)"
    qkv_top = 0.1 / 2  # qkv is op 0, at tp 2
    assert layer.seconds(1)["qkv"] == pytest.approx(0.01e-3)
    assert layer.seconds(16)["qkv"] == pytest.approx(qkv_top / 2 * 1e-3)
    # between knots 16 and 64: linear
    mid = (qkv_top / 2 + qkv_top) / 2
    assert layer.seconds(40)["qkv"] == pytest.approx(mid * 1e-3)
    # beyond the grid: the tail slope from the last knot
    assert layer.seconds(164)["qkv"] == pytest.approx((qkv_top + 100 * 0.001) * 1e-3)
    emb_top = 0.1 * len(OPS) + 0.1  # emb is the last op
    assert layer.emb_s(64) == pytest.approx(emb_top / 2 * 1e-3)


def test_seconds_are_memoized_copies_and_reject_no_tokens(tmp_path):
    layer = OperatorTimes.load("x100", write(tmp_path)).layer(SHAPE, 1)
    first = layer.seconds(10)
    first["qkv"] = -1.0
    assert layer.seconds(10)["qkv"] > 0
    assert set(layer.seconds(10)) == set(OPS)
    with pytest.raises(ValueError, match="num_tokens"):
        layer.seconds(0)


def test_an_op_the_table_lacks_costs_nothing(tmp_path):
    folder = write(tmp_path, tables=[table(skip=("post_norm",))])
    times = OperatorTimes.load("x100", folder).layer(SHAPE, 1).seconds(16)
    assert times["post_norm"] == 0.0 and times["input_norm"] > 0


def test_other_shape_or_tp_reads_the_fitted_curve(tmp_path):
    ops = OperatorTimes.load("x100", write(tmp_path))
    assert not ops.layer(SHAPE, 4).measured  # tp 4 not measured
    other = LayerShape(hidden=64, intermediate=512, num_heads=8, num_kv_heads=2, head_dim=8)
    layer = ops.layer(other, 2)
    assert not layer.measured and layer.source.startswith("fitted: GEMM")
    m, tp = 100, 2
    got = layer.seconds(m)
    heads, kv = 8 // tp, 2 // tp
    assert got["qkv"] == pytest.approx(gemm_formula(m, 64, (heads + 2 * kv) * 8))
    assert got["o"] == pytest.approx(gemm_formula(m, heads * 8, 64))
    assert got["mlp_up"] == pytest.approx(gemm_formula(m, 64, 2 * 512 / tp))
    assert got["mlp_down"] == pytest.approx(gemm_formula(m, 512 / tp, 64))
    elem = np.hypot(ELEM["t0_s"], m * 64 / ELEM["elements_per_s"])  # q = 2
    assert got["input_norm"] == pytest.approx(elem)
    assert layer.emb_s(m) == pytest.approx(elem)


def test_fitted_kv_heads_are_replicated_beyond_one_per_rank(tmp_path):
    ops = OperatorTimes.load("x100", write(tmp_path))
    got = ops.layer(SHAPE, 8).seconds(1)["qkv"]
    assert got == pytest.approx(gemm_formula(1, 64, (1 + 2 * 1) * 8))  # 2 kv heads on 8 ranks
    with pytest.raises(ValueError, match="does not divide num_heads"):
        ops.layer(SHAPE, 3)


def test_fitted_even_where_measured_when_asked(tmp_path):
    ops = OperatorTimes.load("x100", write(tmp_path))
    assert ops.layer(SHAPE, 1).measured and not ops.layer(SHAPE, 1, fitted=True).measured


def test_gemm_and_elementwise(tmp_path):
    ops = OperatorTimes.load("x100", write(tmp_path))
    assert ops.gemm_s(1, 4096, 4096) == pytest.approx(gemm_formula(1, 4096, 4096))
    assert ops.gemm_s(4096, 4096, 4096) == pytest.approx(gemm_formula(4096, 4096, 4096))
    assert ops.gemm_s(1, 4096, 4096, dtype_bytes=1) == pytest.approx(
        gemm_formula(1, 4096, 4096, dtype_bytes=1)
    )
    assert ops.gemm_s(1, 4096, 4096, dtype_bytes=1) < ops.gemm_s(1, 4096, 4096)
    with pytest.raises(ValueError, match="positive"):
        ops.gemm_s(0, 1, 1)
    assert ops.elementwise_s(10, 100) == pytest.approx(np.hypot(1e-6, 1000 / 1e11))
    assert ops.elementwise_s(10, 100, kind="act") == ops.elementwise_s(10, 100)
    with pytest.raises(ValueError, match="unknown elementwise kind"):
        ops.elementwise_s(10, 100, kind="softmax")


def test_two_tables_of_one_shape_read_the_widest(tmp_path):
    folder = write(tmp_path, tables=[table("org/a", top=64), table("org/b", top=128)])
    layer = OperatorTimes.load("x100", folder).layer(SHAPE, 1)
    assert "org/b" in layer.source


def test_exclude_leaves_the_table_and_its_fit_out(tmp_path):
    slow = {**GEMM, "t0_mem_s": 1e-3, "t0_compute_s": 1e-3}
    base = {"gemm": GEMM, "elementwise": {k: ELEM for k in KINDS}}
    folder = write(
        tmp_path,
        tables=[table("org/a"), table("org/b", tps=(4,))],
        without={"org/a": {**base, "gemm": slow}, "org/b": base},
    )
    ops = OperatorTimes.load("x100", folder, exclude="a")  # by name without org
    assert [t.model for t in ops.tables] == ["org/b"]
    assert not ops.layer(SHAPE, 1).measured
    assert ops.gemm_s(1, 8, 8) == pytest.approx(1e-3, rel=1e-3)
    with pytest.raises(ValueError, match="no table for model 'org/c'"):
        OperatorTimes.load("x100", folder, exclude="org/c")


def test_unknown_gpu_names_the_known_ones(tmp_path):
    write(tmp_path, gpu="x100")
    write(tmp_path, gpu="y200")
    assert gpus(tmp_path) == ["x100", "y200"]
    with pytest.raises(ValueError, match=r"'z300'.*\['x100', 'y200'\]"):
        OperatorTimes.load("z300", tmp_path)


def test_bad_file_is_named_with_its_field(tmp_path):
    bad = table()
    bad["tp"]["1"]["qkv"] = knots([1, 64, 16], [0.1, 0.2, 0.3])
    write(tmp_path, tables=[bad])
    with pytest.raises(ValueError, match=r"operators_x100.json: tables\[0\].*op qkv"):
        OperatorTimes.load("x100", tmp_path)
    (tmp_path / "operators_x100.json").write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        OperatorTimes.load("x100", tmp_path)


def test_thinning_keeps_a_step_and_smooths_one_row():
    """The compaction script's grid follows a kernel change (a run of rows) and leaves a
    single odd row to the least-squares average."""
    path = ROOT / "scripts" / "compact_vidur_profiles.py"
    spec = importlib.util.spec_from_file_location("compact_vidur_profiles", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    x = np.arange(1.0, 401.0)
    y = np.where(x <= 200, 1.0, 2.0) + x * 1e-3
    y[99] *= 1.5  # one odd row
    idx, values, miss = mod.thin(x, y, [0, 399], tol=0.05, max_knots=20)
    others = np.delete(miss, 99)
    assert np.median(others) < 0.01 and others.max() < 0.05  # the step is followed
    assert miss[99] > 0.2  # the odd row is not
    assert mod.monotone(np.array([1.0, 3.0, 2.0, 4.0])).tolist() == [1.0, 2.5, 2.5, 4.0]


LLAMA2_70B = LayerShape(hidden=8192, intermediate=28672, num_heads=64, num_kv_heads=8, head_dim=128)


@pytest.mark.parametrize("gpu", ["h100", "a100"])
def test_committed_tables_load_and_cover_what_they_claim(gpu):
    ops = OperatorTimes.load(gpu)
    assert gpu in gpus()
    assert len(ops.tables) >= 6
    for tab in ops.tables:
        for tp, per_op in tab.ops.items():
            assert tp in (1, 2, 4, 8)
            missing = {*OPS, "emb"} - set(per_op)
            assert missing <= {"post_norm"}, (tab.model, tp, missing)
            layer = ops.layer(tab.shape, tp)
            assert layer.measured
            lo, hi = tab.num_tokens
            assert lo == 1 and hi >= 4096
            times = [sum(layer.seconds(t).values()) for t in (1, 512, hi, 2 * hi)]
            assert all(t > 0 for t in times) and times[-1] > times[0]
        # every model has its leave-one-out fit
        without = OperatorTimes.load(gpu, exclude=tab.model)
        assert tab.model not in [t.model for t in without.tables]
    # Llama-3-70B's layer is Llama-2-70B's shape: a measured table at every TP degree
    for tp in (1, 2, 4, 8):
        assert ops.layer(LLAMA2_70B, tp).measured
    unknown = LayerShape(
        hidden=5120, intermediate=17408, num_heads=40, num_kv_heads=8, head_dim=128
    )
    fitted = ops.layer(unknown, 2)
    assert not fitted.measured
    assert 0 < sum(fitted.seconds(1).values()) < sum(fitted.seconds(4096).values())
