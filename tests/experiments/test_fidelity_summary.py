"""The fidelity summary counts the pairs that meet every target, per variant."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from experiments import fidelity_summary as fs


def row(trace: str, policy: str, **errors: float) -> dict:
    return {"trace": trace, "policy": policy, **errors}


def met(prefix: str = "", **over: float) -> dict:
    base = {
        "err_throughput_req_s": 0.01,
        "err_tpot_s_mean": -0.03,
        "err_e2e_s_mean": 0.049,
        "err_ttft_s_p50": -0.09,
    }
    base.update(over)
    return {prefix + k: v for k, v in base.items()}


def write(folder, rows: list[dict], meta: dict | None = None):
    folder.mkdir(parents=True)
    pd.DataFrame(rows).to_csv(folder / "fidelity.csv", index=False)
    (folder / "fidelity.json").write_text(json.dumps({"meta": meta or {}}))
    return folder


def test_counts_pairs_meeting_all_four_targets_per_variant(tmp_path):
    folder = write(
        tmp_path / "exp",
        [
            row("azure_conv", "fcfs", **met(), **met("own_"), **met("win_")),
            # misses only p50 TTFT (10% bound) from the profile alone; own speed misses E2E
            row(
                "azure_conv",
                "sjf",
                **met(err_ttft_s_p50=0.11),
                **met("own_", err_e2e_s_mean=-0.06),
                **met("win_"),
            ),
            # the real engine against its repeat: counted apart, never as a pair
            row("azure_conv", "fcfs" + fs.NOISE, **met(err_tpot_s_mean=0.07)),
        ],
        meta={"profile_fit_rel_error": 0.034, "repeats": 2, "date": "2026-12-03"},
    )
    s = fs.summarize(folder)
    assert s["fit"] == pytest.approx(0.034)
    assert s["variants"]["profile"]["met"] == 1 and s["variants"]["profile"]["pairs"] == 2
    assert s["variants"]["profile"]["misses"] == {"azure_conv/sjf": ["err_ttft_s_p50 +11.0%"]}
    assert s["variants"]["own"]["met"] == 1
    assert s["variants"]["window"]["met"] == 2
    # variants the experiment did not compute are absent, not misses
    assert "reference" not in s["variants"] and "neighbours" not in s["variants"]
    assert s["noise"] == {"met": 0, "comparisons": 1}
    table = fs.markdown([s])
    assert "| `exp/` | 3.4% | 1 / 2 | – | – | 1 / 2 | 2 / 2 | 0 / 1 |" in table


def test_a_missing_metric_is_a_miss_not_a_pass(tmp_path):
    errors = met("nb_")
    del errors["nb_err_ttft_s_p50"]
    folder = write(tmp_path / "exp", [row("mooncake_conv", "vtc", **met(), **errors)])
    s = fs.summarize(folder)
    assert s["fit"] is None
    assert s["variants"]["neighbours"]["met"] == 0
    assert s["variants"]["neighbours"]["misses"]["mooncake_conv/vtc"] == ["err_ttft_s_p50: missing"]


def test_main_skips_folders_without_results_and_names_them(tmp_path, capsys):
    good = write(tmp_path / "good", [row("azure_conv", "fcfs", **met())])
    empty = tmp_path / "empty"
    empty.mkdir()
    fs.main([str(good), str(empty), "--out", str(tmp_path / "out")])
    captured = capsys.readouterr()
    assert "skipped" in captured.err and "empty" in captured.err
    written = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert written["experiments"][0]["experiment"] == "good"
    assert (tmp_path / "out" / "manifest.json").is_file()
    with pytest.raises(SystemExit):
        fs.main([str(empty)])


def test_a_results_folder_is_read_by_the_shared_reader_and_refused_by_name(tmp_path):
    folder = write(tmp_path / "bad", [{"policy": "fcfs", **met()}])
    with pytest.raises(SystemExit, match=r"fidelity\.csv: no 'trace' column"):
        fs.summarize(folder)
    twice = write(tmp_path / "twice", [row("azure_conv", "fcfs", **met())] * 2)
    with pytest.raises(SystemExit, match=r"rows \[2, 3\] repeat the pair azure_conv / fcfs"):
        fs.summarize(twice)
    (twice / "fidelity.json").unlink()
    with pytest.raises(SystemExit, match=r"no fidelity\.json"):
        fs.summarize(twice)


def test_split_against_speed_recovers_a_known_slope_within_each_experiment(tmp_path):
    import math

    summaries = []
    # b sits higher than a: only the spread within each experiment counts
    for name, level in (("a", 0.0), ("b", 0.3)):
        rows = []
        for policy, factor in (("fcfs", 0.9), ("sjf", 1.0), ("vtc", 1.2)):
            target = level + 0.5 * math.log(factor)  # split = level + 0.5 log(f)
            decode = 0.02
            rows.append(
                row(
                    "azure_conv",
                    policy,
                    **met(),
                    own_speed_factor=factor,
                    step_err_decode_total=decode,
                    step_err_prefill_total=(1 + target) * (1 + decode) - 1,
                )
            )
        summaries.append(fs.summarize(write(tmp_path / name, rows)))
    assert summaries[0]["splits"][2]["split"] == pytest.approx(0.5 * math.log(1.2))
    relation = fs.split_vs_speed(summaries)
    assert relation["slope"] == pytest.approx(0.5)
    assert relation["corr"] == pytest.approx(1.0)
    assert relation["pairs"] == 6
    # without the speed factor there is nothing to relate
    plain = fs.summarize(write(tmp_path / "c", [row("azure_conv", "fcfs", **met())]))
    assert plain["splits"][0]["split"] is None
    assert fs.split_vs_speed([plain]) is None
