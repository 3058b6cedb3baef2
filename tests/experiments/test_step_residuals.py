"""Step residuals: idle gaps before steps, and scale against a fixed per-step cost."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from experiments import step_residuals as sr


class Linear:
    """A stand-in latency model: 1 ms per token plus 5 ms per step."""

    def predict_many(self, num_reqs, tokens, attn_pairs, kv_tokens, max_kv):
        return 0.005 + 0.001 * np.asarray(tokens, float)


def write_run(folder, rows):
    folder.mkdir(parents=True)
    pd.DataFrame(rows).to_csv(folder / "steps.csv", index=False)
    return folder


def step(start, latency, reqs, prefill, decode):
    return {"start_s": start, "latency_s": latency, "num_reqs": reqs,
            "num_prefill_tokens": prefill, "num_decode_tokens": decode,
            "attn_pairs": 0, "kv_tokens": 0, "max_kv": 0}  # fmt: skip


def test_gaps_count_from_the_last_busy_step_and_errors_are_per_kind(tmp_path):
    # a prefill (100 tokens: predicted 0.105 s) after 10 s idle (with an idle row between),
    # then two decodes back to back, measured 10% slower than predicted
    run = write_run(tmp_path / "azure_conv" / "fcfs-real", [
        step(0.0, 0.105, 1, 100, 0),
        step(0.105, 10.0, 0, 0, 0),
        step(10.105, 0.105, 1, 100, 0),
        step(10.21, 0.0066, 1, 0, 1),
        step(10.2166, 0.0066, 1, 0, 1),
    ])  # fmt: skip
    steps = sr.run_steps(run, Linear())
    assert len(steps) == 4
    assert steps["gap_s"].tolist() == pytest.approx([0.0, 10.0, 0.0, 0.0], abs=1e-9)
    table = sr.gap_table(steps).set_index(["kind", "gap"])
    assert table.loc[("prefill", ">5 s"), "steps"] == 1
    assert table.loc[("prefill", "<0.5 ms"), "err"] == pytest.approx(0.0, abs=1e-9)
    assert table.loc[("decode", "<0.5 ms"), "err"] == pytest.approx(0.006 / 0.0066 - 1)
    assert set(table.reset_index()["trace"]) == {"azure_conv"}


def test_affine_fit_separates_a_fixed_cost_from_a_change_of_speed(tmp_path):
    tokens = [1, 1, 2, 50, 200, 1, 3, 500]
    rows, t = [], 0.0
    for n in tokens:
        real = 1.1 * (0.005 + 0.001 * n) + 0.002  # 10% slower and 2 ms more per step
        rows.append(step(t, real, 1, n if n > 3 else 0, n if n <= 3 else 0))
        t += real
    fit = sr.affine(sr.run_steps(write_run(tmp_path / "moon" / "r-real", rows), Linear()))
    assert fit["a"] == pytest.approx(1.1, rel=1e-6)
    assert fit["b_ms"] == pytest.approx(2.0, rel=1e-6)
    assert fit["ratio"] > 1.1


def test_a_run_without_its_steps_is_refused_by_name(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no steps\.csv"):
        sr.run_steps(tmp_path, Linear())
    bad = write_run(tmp_path / "x", [{"start_s": 0, "latency_s": 1}])
    with pytest.raises(ValueError, match="num_reqs"):
        sr.run_steps(bad, Linear())


def test_decodes_are_grouped_by_batch_and_longest_context(tmp_path):
    rows, t = [], 0.0
    for reqs, ctx, slow in ((1, 100, 1.0), (1, 1200, 1.2), (1, 1300, 1.2), (6, 1300, 1.0)):
        pred = 0.005 + 0.001 * reqs
        rows.append({**step(t, slow * pred, reqs, 0, reqs), "max_kv": ctx})
        t += slow * pred
    steps = sr.run_steps(write_run(tmp_path / "azure_conv" / "r-real", rows), Linear())
    table = sr.decode_table(steps, least=1).set_index(["batch", "context"])
    assert table.loc[(1, "<=128"), "err"] == pytest.approx(0.0, abs=1e-9)
    assert table.loc[(1, "<=1536"), "steps"] == 2
    assert table.loc[(1, "<=1536"), "err"] == pytest.approx(1 / 1.2 - 1)
    assert table.loc[(4, "<=1536"), "steps"] == 1  # 6 requests: the "4 or more" group
    assert len(sr.decode_table(steps, least=2)) == 1


def test_shape_ratios_ignore_a_uniform_change_of_speed(tmp_path):
    rows, t = [], 0.0
    for reqs, prefill, slow in ((1, 0, 1.3), (2, 0, 1.3), (5, 0, 1.0), (1, 100, 1.0)):
        pred = 0.005 + 0.001 * (prefill or reqs)
        rows.append(step(t, 2.0 * slow * pred, reqs, prefill, 0 if prefill else reqs))
        t += 2.0 * slow * pred
    steps = sr.run_steps(write_run(tmp_path / "azure_conv" / "r-real", rows), Linear())
    got = sr.shape(steps)
    # the machine twice as slow moves the total, not the ratios
    assert got["small_vs_large"] == pytest.approx(1 / 1.3 - 1)
    assert got["split"] > 0  # the prefill is not slowed beyond the factor 2; the small decodes are
    assert got["err_total"] < -0.5


def test_steps_are_told_apart_by_kind_and_priced_at_the_runs_own_speed(tmp_path):
    # A decode step, one prompt alone, 5 prompts packed, 3 prompts beside 4 decodes;
    # the packed step ran 1.5x its prediction, the rest as predicted, all 2x slower.
    rows, t = [], 0.0
    for reqs, prefill, decode, slow in (
        (8, 0, 8, 1.0),
        (1, 200, 0, 1.0),
        (5, 200, 0, 1.5),
        (7, 200, 4, 1.0),
    ):
        real = 2 * slow * (0.005 + 0.001 * (prefill + decode))
        rows.append(step(t, real, reqs, prefill, decode))
        t += real
    steps = sr.run_steps(write_run(tmp_path / "burst" / "sjf-real", rows), Linear())
    assert list(sr.step_kind(steps)) == ["decode only", "one prefill", "many prefills", "mixed"]
    table = sr.kind_table(steps).set_index("kind")
    assert table["steps"].tolist() == [1, 1, 1, 1]
    assert table.loc["one prefill", "err"] == pytest.approx(-0.5)  # the run is 2x slower
    speed = sum(r["latency_s"] for r in rows) / steps["pred_s"].sum()
    packed = table.loc["many prefills"]
    assert packed["err_own_speed"] == pytest.approx(speed / 3 - 1)
    assert table.loc["decode only", "err_own_speed"] == pytest.approx(speed / 2 - 1)
    own = (table["pred_s"] * speed).sum() / table["real_s"].sum()
    assert own == pytest.approx(1.0)  # in total, exact at the run's own speed
