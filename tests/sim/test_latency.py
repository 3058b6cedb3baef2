"""Latency models: the roofline's physics, the profile reader and its extrapolation."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from testbed.sim.fitting import nnls
from testbed.sim.latency import decode_latencies
from testbed.sim.profile_model import ProfileModel
from tests.sim.helpers import latency_model


def test_roofline_decode_is_bound_by_weight_reads_and_grows_with_context():
    model = latency_model("llama3-8b", "h200")
    floor = model.model.weight_bytes("bfloat16") / 4.8e12  # 16 GB at 4.8 TB/s = 3.35 ms
    one = model.predict(1, 1, 1025.0, 1025, 1025)
    assert one > floor and floor == pytest.approx(3.35e-3, rel=0.02)
    batch = model.predict(64, 64, 64 * 4097.0, 64 * 4097, 4097)
    assert batch > one  # KV reads of 64 x 4k contexts add to the weights
    prefill = model.predict(1, 4096, 4096 * 2048.5, 4096, 4096)
    assert prefill > 2 * 8e9 * 4096 / 989e12  # at least the FLOPs at peak


def test_vectorized_decode_latencies_equal_scalar_predictions_exactly():
    model = latency_model("llama3-8b", "h200")
    lat = decode_latencies(model, 7, 12_345, 50, 4000)
    scalar = [
        model.predict(7, 7, float(12_345 + 7 * j), 12_345 + 7 * j, 4000 + j) for j in range(1, 51)
    ]
    assert lat.tolist() == scalar


def write_profile(path, rows, header="# device: test-device\n# date: 2026-11-29\n"):
    lines = [header + "kind,num_reqs,num_tokens,attn_pairs,kv_tokens,latency_s"]
    lines += [f"step,{r},{t},{p},{k},{lat}" for r, t, p, k, lat in rows]
    path.write_text("\n".join(lines) + "\n")


def test_profile_model_fits_a_measured_table_and_extrapolates_sanely(tmp_path):
    rng = np.random.default_rng(0)
    truth = np.array([2e-3, 1e-4, 2e-6, 1e-10, 5e-9])  # overheads, tokens, pairs, kv
    rows = []
    for reqs in (1, 4, 8, 16, 64):
        for tokens_per in (1, 32, 256):
            ctx = int(rng.integers(64, 4096))
            t, p, k = reqs * tokens_per, reqs * tokens_per * (ctx + tokens_per / 2), reqs * ctx
            lat = truth @ [1, reqs, t, p, k] * (1 + 0.02 * rng.standard_normal())
            rows.append((reqs, t, p, k, lat))
    path = tmp_path / "m.csv"
    write_profile(path, rows)
    model = ProfileModel(path)
    assert model.header["device"] == "test-device" and model.kind == "profile"
    assert model.fit_rel_error < 0.05
    assert (model.coef >= 0).all()
    # Far outside the grid: positive, finite and at most linear growth.
    small, big = model.predict(1, 1, 1.0, 1, 1), model.predict(1024, 65536, 1e11, 1e8, 1e6)
    assert 0 < small < big < np.inf
    assert model.predict(2048, 131072, 2e11, 2e8, 2e6) <= 2.01 * big


def test_profile_model_rejects_incomplete_tables(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("num_reqs,latency_s\n1,0.1\n")
    with pytest.raises(ValueError, match="lacks columns"):
        ProfileModel(path)
    write_profile(path, [(1, 1, 1.0, 1, 0.1)])
    with pytest.raises(ValueError, match="too few"):
        ProfileModel(path)


def test_nnls_matches_an_unconstrained_fit_when_that_is_nonnegative_and_clips_otherwise():
    rng = np.random.default_rng(1)
    a = rng.random((40, 3))
    x = nnls(a, a @ np.array([1.0, 2.0, 3.0]))
    assert np.allclose(x, [1, 2, 3])
    x = nnls(a, a @ np.array([1.0, -2.0, 3.0]))
    assert (x >= 0).all() and x[1] == 0


def test_profile_model_vectorized_predictions_equal_scalar_ones_exactly(tmp_path):
    rows = [
        (r, r * t, r * t * 300.0, r * 300, 1e-3 + 1e-4 * r + 1e-6 * r * t + 1e-4 * min(r, 8))
        for r in (1, 2, 4, 8, 16, 64)
        for t in (1, 16, 64)
    ]
    write_profile(tmp_path / "p.csv", rows)
    model = ProfileModel(tmp_path / "p.csv")
    lat = decode_latencies(model, 5, 1000, 30, 300)
    assert lat.tolist() == [
        model.predict(5, 5, float(1000 + 5 * j), 1000 + 5 * j, 300 + j) for j in range(1, 31)
    ]


def test_profile_model_charges_unequal_contexts_through_max_kv(tmp_path):
    """Decode steps whose cost follows the longest context (a kernel that loops
    over its chunks): with ``max_kv`` in the table the fit tells a ragged batch
    from an even one of the same total; a table without it is read as even."""
    rng = np.random.default_rng(2)
    lines = ["kind,num_reqs,num_tokens,attn_pairs,kv_tokens,max_kv,latency_s"]
    for _ in range(60):
        reqs = int(rng.integers(1, 32))
        ctxs = rng.integers(16, 2048, size=reqs)
        kv, longest = int(ctxs.sum()), int(ctxs.max())
        lat = 2e-3 + 1e-4 * reqs + 2e-8 * kv + 3e-6 * longest
        lines.append(f"step,{reqs},{reqs},{float(kv)},{kv},{longest},{lat}")
    path = tmp_path / "ragged.csv"
    path.write_text("\n".join(lines) + "\n")
    model = ProfileModel(path)
    assert model.fit_rel_error < 0.01
    even = model.predict(4, 4, 4000.0, 4000, 1000)
    ragged = model.predict(4, 4, 4000.0, 4000, 1900)
    assert ragged - even == pytest.approx(3e-6 * 900, rel=0.1)
    # An older table (no max_kv column) still loads: contexts taken as equal.
    old = [(r, r, r * 500.0, r * 500, 1e-3 * r) for r in range(1, 21)]
    write_profile(tmp_path / "old.csv", old)
    assert ProfileModel(tmp_path / "old.csv").predict(2, 2, 1000.0, 1000, 500) > 0


def test_profile_model_follows_small_decode_batches_that_cost_more_than_larger_ones(tmp_path):
    """A GEMM of 2 or 3 rows that costs more than one of 4 (the LM head on one CPU
    thread): each small decode-only batch gets its own term, so the fit follows
    the measured sizes; steps with a prefill, sizes past the table and sizes the
    profile has too few rows of keep the smooth model."""
    rng = np.random.default_rng(3)
    bump = {2: 1.5e-3, 3: 3.5e-3}  # seconds on top of a smooth cost
    lines = ["kind,num_reqs,num_tokens,attn_pairs,kv_tokens,max_kv,latency_s"]
    for _ in range(400):
        reqs = int(rng.integers(1, 40))
        ctx = int(rng.integers(64, 1024))
        chunk = int(rng.choice([0, 0, 0, 64, 256]))
        tokens, kv = reqs + chunk, reqs * ctx + chunk
        lat = 2e-3 + 4e-4 * reqs + 2e-6 * tokens + 1e-8 * kv + (0 if chunk else bump.get(reqs, 0))
        pairs = float(reqs * ctx + chunk * chunk / 2)
        lines.append(f"step,{reqs},{tokens},{pairs},{kv},{ctx},{lat}")
    path = tmp_path / "small.csv"
    path.write_text("\n".join(lines) + "\n")
    model = ProfileModel(path)
    assert model.fit_rel_error < 0.01

    def decode(n):
        return model.predict(n, n, float(n * 500), n * 500, 500)

    assert decode(3) > decode(4) > decode(1)
    assert decode(3) - decode(4) == pytest.approx(3.5e-3 - 4e-4 - 2e-6 - 5e-6, rel=0.1)
    # A prefill chunk beside 3 decodes pays no decode-size term.
    mixed = model.predict(3, 3 + 64, 1500.0 + 2048, 1500 + 64, 500)
    assert mixed == pytest.approx(2e-3 + 12e-4 + 2e-6 * 67 + 1e-8 * 1564, rel=0.05)
    # Vectorized predictions agree exactly, decode and mixed steps alike.
    reqs = np.array([1, 2, 3, 4, 3, 17, 40], dtype=float)
    tokens = reqs + np.array([0, 0, 0, 0, 64, 0, 0])
    kv = reqs * 500
    many = model.predict_many(reqs, tokens, kv.astype(float), kv, np.full(7, 500.0))
    one = [model.predict(r, t, float(k), k, 500.0) for r, t, k in zip(reqs, tokens, kv)]
    assert many.tolist() == one
    # Sizes with fewer than DECODE_SIZE_ROWS rows get no term of their own.
    few = [line for line in lines if not line.startswith("step,3,3,")]
    few += [line for line in lines if line.startswith("step,3,3,")][:2]
    (tmp_path / "few.csv").write_text("\n".join(few) + "\n")
    assert ProfileModel(tmp_path / "few.csv")._decode_extra[3] == 0.0


def test_profile_model_fits_a_gpus_weight_bound_then_compute_bound_steps(tmp_path):
    # On a GPU a step's linear layers cost the same for 1 and 100 tokens (weight
    # reads), then a time per token (compute): a knee that a line in tokens cannot
    # follow. Steps shaped so (the H200 roofline for Llama-3-8B as the truth, on
    # the profiler's gpu grid and replay-like mixes) are fitted to within a few
    # percent, decodes of 1-256 requests and 2048-token chunks alike.
    from testbed.profiling.grid import GRIDS

    truth = latency_model("llama3-8b", "h200")
    rng = np.random.default_rng(0)
    shapes = [(*g, 0)[:4] for g in GRIDS["gpu"]]  # (decodes, context, prefill, cached prefix)
    for _ in range(300):
        d, c = int(rng.integers(1, 257)), int(rng.integers(100, 3000))
        shapes.append((d, c, int(rng.choice([0, 0, int(rng.integers(16, 2048 - d))])), 0))
    rows = []
    for d, c, p, pre in shapes:
        reqs, tokens = d + (p > 0), d + p
        pairs, kv = d * (c + 1) + p * (pre + (p + 1) / 2), d * (c + 1) + pre + p
        max_kv = max(c, pre + p)
        rows.append((reqs, tokens, pairs, kv, truth.predict(reqs, tokens, pairs, kv, max_kv)))
    path = tmp_path / "gpu.csv"
    write_profile(path, rows)
    model = ProfileModel(path)
    # The table has no max_kv column: the model takes it as kv_tokens / num_reqs.
    err = np.array([abs(model.predict(*r[:4], np.ceil(r[3] / r[0])) / r[4] - 1) for r in rows])
    assert np.median(err) < 0.01 and np.quantile(err, 0.9) < 0.03 and err.max() < 0.15


def test_profile_model_takes_its_level_from_the_replay_and_its_shape_from_all_rows(tmp_path):
    # The grid's points (each batch repeated back to back) run 3% faster than the
    # same compositions in a replay, and the steps are noisy (where a least-squares
    # fit of relative errors sits below their mean). The model predicts the replay's
    # busy time in total, and the grid's points 3% slow.
    rng = np.random.default_rng(1)
    truth = np.array([4e-3, 3e-4, 1e-4, 5e-9, 2e-8])  # constant, requests, tokens, pairs, kv

    def row(group, reqs, tokens_per, ctx, factor):
        t, p, k = reqs * tokens_per, reqs * tokens_per * (ctx + tokens_per / 2), reqs * ctx
        lat = truth @ [1, reqs, t, p, k] * factor * (1 + 0.05 * rng.standard_normal())
        return f"step,{group},{reqs},{t},{p},{k},{ctx + tokens_per},{lat}"

    lines = [
        "# device: test-device",
        "kind,grid,num_reqs,num_tokens,attn_pairs,kv_tokens,max_kv,latency_s",
    ]
    lines += [
        row("point", r, n, c, 0.97) for r in (1, 2, 4, 8) for n in (1, 64) for c in (64, 1024)
    ]
    # The replay's steps: the same compositions, in flow, 20 of each.
    lines += [
        row("replay", r, n, c, 1.0)
        for _ in range(20)
        for r in (1, 2, 4, 8)
        for n in (1, 64)
        for c in (64, 1024)
    ]
    path = tmp_path / "m.csv"
    path.write_text("\n".join(lines) + "\n")
    table = pd.read_csv(path, comment="#")
    model = ProfileModel(path)
    pred = model_predictions(model, table)
    replay, grid = (table["grid"] == "replay").to_numpy(), (table["grid"] == "point").to_numpy()
    y = table["latency_s"].to_numpy()
    assert pred[replay].sum() == pytest.approx(y[replay].sum(), rel=1e-9)
    assert pred[grid].sum() / y[grid].sum() == pytest.approx(1 / 0.97, abs=0.02)
    assert model.level > 1.0 and f"level {model.level:.4f}" in model.source
    # Scaled, scalar, vectorised and decode-run predictions still agree exactly.
    scalar = [
        model.predict(int(r.num_reqs), int(r.num_tokens), r.attn_pairs, int(r.kv_tokens), r.max_kv)
        for r in table.itertuples()
    ]
    assert pred.tolist() == scalar
    decode = [model.predict(4, 4, float(1000 + 4 * j), 1000 + 4 * j, 300 + j) for j in range(1, 11)]
    assert decode_latencies(model, 4, 1000, 10, 300).tolist() == decode
    # Without a replay, nothing to take a level from.
    path.write_text("\n".join(lines[: 2 + 16]) + "\n")
    assert ProfileModel(path).level == 1.0


def model_predictions(model, table):
    cols = ("num_reqs", "num_tokens", "attn_pairs", "kv_tokens", "max_kv")
    return model.predict_many(*(table[c].to_numpy(float) for c in cols))


def test_the_sparse_replays_steps_are_fitted_and_levelled_as_replay_steps(tmp_path):
    # The same table with part of its replay labelled as the profiler's sparse
    # replay (``replay_sparse``) fits the same model: same coefficients, same level.
    rng = np.random.default_rng(2)
    lines = ["kind,grid,num_reqs,num_tokens,attn_pairs,kv_tokens,max_kv,latency_s"]
    for group, factor in (("point", 0.97), ("replay", 1.0), ("replay", 1.0)):
        for reqs in (1, 2, 4, 8):
            for ctx in (64, 512, 1024):
                lat = (4e-3 + 3e-4 * reqs + 2e-8 * reqs * ctx) * factor
                lat *= 1 + 0.05 * rng.standard_normal()
                lines.append(f"step,{group},{reqs},{reqs},{reqs * ctx},{reqs * ctx},{ctx},{lat}")
    plain = tmp_path / "plain.csv"
    plain.write_text("\n".join(lines) + "\n")
    sparse = tmp_path / "sparse.csv"
    relabelled = lines[: 1 + 12 + 12] + [
        line.replace(",replay,", ",replay_sparse,") for line in lines[1 + 12 + 12 :]
    ]
    sparse.write_text("\n".join(relabelled) + "\n")
    a, b = ProfileModel(plain), ProfileModel(sparse)
    assert "replay_sparse" in pd.read_csv(sparse)["grid"].tolist()
    assert b.level == pytest.approx(a.level, rel=1e-12) and a.level != 1.0
    assert np.allclose(b.coef, a.coef, rtol=1e-12, atol=0)


def test_a_real_runs_speed_against_its_profile_is_its_busy_time_over_the_prediction(tmp_path):
    """speed_against: the run's busy steps' time over the model's prediction of
    them, overall and per minute; idle steps do not count; a StepLog and its
    steps.csv frame give the same answer."""
    from testbed.metrics.steplog import StepLog
    from testbed.sim.run_speed import predict_logged_steps, speed_against

    rows = [(r, r * t, r * t * 300.0, r * 300, 1e-3 + 1e-4 * r + 1e-6 * r * t)
            for r in (1, 2, 4, 8, 16) for t in (1, 16, 64)]  # fmt: skip
    write_profile(tmp_path / "p.csv", rows)
    model = ProfileModel(tmp_path / "p.csv")
    rng = np.random.default_rng(1)
    log = StepLog()
    now = 0.0
    for _ in range(600):
        reqs = int(rng.integers(1, 9))
        prefill = int(rng.choice([0, 0, 0, 64]))
        step = StepLog()  # one row, to ask the model for its prediction
        args = (0, now, 1.0, reqs, prefill, reqs, 0.1, 0, reqs, 0, 300.0 * reqs, 9e3, 400.0)
        step.add(*args)
        pred = float(predict_logged_steps(model, step)[0])
        factor = 1.25 if now < 60 else 1.0  # a slow first minute, then as profiled
        log.add(0, now, pred * factor, *args[3:])
        now += pred * factor
        log.add(0, now, 0.2, 0, 0, 0, 0.0, 0, 0, 0)  # an idle wait: not a step's work
        now += 0.2
    speed = speed_against(model, log)
    pred = predict_logged_steps(model, log)
    busy = log.column("num_reqs") > 0
    real = log.column("latency_s")[busy]
    assert speed["speed_vs_profile"] == pytest.approx(real.sum() / pred[busy].sum())
    assert 1.0 < speed["speed_vs_profile"] < 1.25
    assert speed["speed_vs_profile_max"] == pytest.approx(1.25)
    assert speed["speed_vs_profile_min"] == pytest.approx(1.0)
    assert speed_against(model, log.to_frame()) == pytest.approx(speed)
    idle = StepLog()
    idle.add(0, 0.0, 0.05, 0, 0, 0, 0.0, 0, 0, 0)
    assert speed_against(model, idle) == {}


def test_a_proposers_time_is_left_out_of_every_window_as_of_the_whole_run(tmp_path):
    """speed_against with a proposer's time per step (exclude_s): every step ran
    at the profile's speed plus the proposer's time, a small share of the first
    minute and several times the step in the later ones; with that time left out
    the whole run and each minute are at 1.0, so the whole run lies within its
    windows' range."""
    from testbed.metrics.steplog import StepLog
    from testbed.sim.run_speed import predict_logged_steps, speed_against, time_per_step

    rows = [(r, r * t, r * t * 300.0, r * 300, 1e-3 + 1e-4 * r + 1e-6 * r * t)
            for r in (1, 2, 4, 8, 16) for t in (1, 16, 64)]  # fmt: skip
    write_profile(tmp_path / "p.csv", rows)
    model = ProfileModel(tmp_path / "p.csv")
    log, starts, proposing = StepLog(), [], []
    shape = (4, 0, 4, 0.1, 0, 4, 0, 1200.0, 4800.0, 300.0)  # every step's composition
    one = StepLog()
    one.add(0, 0.0, 1.0, *shape)
    pred = float(predict_logged_steps(model, one)[0])
    now = 0.0
    while now < 180:
        args = (0, now, 1.0, *shape)
        extra = pred * (0.1 if now < 60 else 3.0)  # the proposer, inside the step
        log.add(0, now, pred + extra, *args[3:])
        starts.append(now + pred)
        proposing.append(extra)
        now += pred + extra
    exclude = time_per_step(log.column("start_s"), starts, proposing)
    assert exclude == pytest.approx(proposing)
    speed = speed_against(model, log, exclude_s=exclude)
    assert speed["speed_vs_profile"] == pytest.approx(1.0)
    assert speed["speed_vs_profile_min"] == pytest.approx(1.0)
    assert speed["speed_vs_profile_max"] == pytest.approx(1.0)
    assert speed_against(model, log)["speed_vs_profile_max"] > 3.5  # with it: 4x


def test_time_per_step_sums_each_time_into_the_step_it_fell_in():
    from testbed.sim.run_speed import time_per_step

    got = time_per_step([0.0, 1.0, 2.5], [-0.5, 0.2, 0.9, 1.0, 3.0], [9.0, 1.0, 2.0, 4.0, 8.0])
    assert got.tolist() == [3.0, 4.0, 8.0]  # the one before the first step: none
    assert time_per_step([0.0, 1.0], [], []).tolist() == [0.0, 0.0]


def test_profile_model_charges_requests_verifying_drafts_their_own_cost(tmp_path):
    # Steps cost a base by their features plus 0.4 ms per request verifying drafts
    # (a CPU attention path's per-sequence loop), which the features alone cannot
    # tell from a prefill chunk's tokens: the verification points pin it.
    rng = np.random.default_rng(3)
    per_request = 4e-4

    def base(reqs, tokens, ctx):
        return 2e-3 + 1e-4 * reqs + 2e-5 * tokens + 1e-8 * reqs * ctx

    lines = [
        "kind,grid,decode_batch,context,prefill_tokens,drafts,"
        "num_reqs,num_tokens,attn_pairs,kv_tokens,max_kv,latency_s"
    ]
    for grid in ("point", "replay"):
        for reqs in (1, 2, 4, 8, 16, 32, 64):
            for ctx in (64, 256, 1024):
                noise = 1 + 0.02 * rng.standard_normal()
                lat = base(reqs, reqs, ctx) * noise
                lines.append(
                    f"step,{grid},{reqs},{ctx},0,0,{reqs},{reqs},{reqs * (ctx + 1)},"
                    f"{reqs * (ctx + 1)},{ctx + 1},{lat}"
                )
                n = 64 if grid == "point" else 1  # one prefill chunk beside the decodes
                lines.append(
                    f"step,{grid},{reqs},{ctx},{n},0,{reqs + 1},{reqs + n},"
                    f"{reqs * (ctx + 1) + n * (n + 1) / 2},{reqs * (ctx + 1) + n},{ctx + 1},"
                    f"{base(reqs + 1, reqs + n, ctx) * noise}"
                )
    for reqs in (1, 4, 16, 64):
        for ctx in (256, 1024):
            t = 4 * reqs
            lat = base(reqs, t, ctx) + per_request * reqs
            lines.append(
                f"step,point,{reqs},{ctx},0,3,{reqs},{t},{reqs * 4 * (ctx + 2.5)},"
                f"{reqs * (ctx + 4)},{ctx + 4},{lat}"
            )
    path = tmp_path / "spec.csv"
    path.write_text("\n".join(lines) + "\n")
    model = ProfileModel(path)
    assert model.verification_s(1) == pytest.approx(per_request, rel=0.15)
    assert model.verification_s(np.array([0.0, 10.0])).tolist() == [
        0.0,
        pytest.approx(10 * per_request, rel=0.15),
    ]
    # 64 requests verifying 3 drafts each at context 256: features + their term.
    pred = model.predict(64, 256, 64 * 4 * 258.5, 64 * 260, 260) + model.verification_s(64)
    assert pred == pytest.approx(base(64, 256, 256) + 64 * per_request, rel=0.1)
    # A table without verification points has no such term.
    path.write_text("\n".join(line for line in lines if ",0,3," not in line) + "\n")
    assert ProfileModel(path).verification_s(5) == 0.0
