"""The experiment's written record: the tables (``fidelity.csv``, ``.json``,
``.md``, the policy effects, the steps by batch, the runs' speeds), the plots,
the console lines, and reading a written experiment back."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from testbed.metrics.fidelity import join_requests

from .compare import LATENCIES
from .speeds import TRACE_WINDOW_S, WINDOW_S


def read_experiment(path: Path) -> tuple[dict, pd.DataFrame]:
    """An experiment's ``meta`` (from ``fidelity.json``) and its table (``fidelity.csv``)."""
    files = {name: path / name for name in ("fidelity.json", "fidelity.csv")}
    for name, file in files.items():
        if not file.is_file():
            raise SystemExit(f"{path}: no {name} (the --out directory of experiments.fidelity)")
    meta = json.loads(files["fidelity.json"].read_text()).get("meta")
    if not isinstance(meta, dict):
        raise SystemExit(f"{files['fidelity.json']}: no 'meta' object")
    table = pd.read_csv(files["fidelity.csv"])
    for column in ("trace", "policy"):
        if column not in table:
            raise SystemExit(f"{files['fidelity.csv']}: no '{column}' column")
    twice = table.duplicated(["trace", "policy"], keep=False)
    if twice.any():
        first = table[twice].iloc[0]
        raise SystemExit(
            f"{files['fidelity.csv']}: rows {[i + 2 for i in table.index[twice]]} repeat the "
            f"pair {first['trace']} / {first['policy']}: one row per pair"
        )
    return meta, table


def markdown_table(columns: list[str], rows: list[list[str]], left: int) -> str:
    """A Markdown table: the first ``left`` columns aligned left, the rest (numbers)
    right."""
    align = ["---"] * left + ["---:"] * (len(columns) - left)
    lines = [columns, align, *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines) + "\n"


MARKDOWN = {  # column: heading, for the summary table
    "err_throughput_req_s": "throughput",
    "err_tpot_s_mean": "TPOT mean",
    "err_e2e_s_mean": "E2E mean",
    "err_ttft_s_p50": "TTFT p50",
    "e2e_corr": "E2E corr",
    "real_spread_tpot_s_mean": "real runs' spread, TPOT mean",
    "real_queued_steps": "steps with a queue",
    "step_err_total": "steps (busy time)",
    "step_err_per_request": "steps (per request)",
    "pass_err_tpot_s_mean": "TPOT mean, per-pass sims",
    "pass_err_e2e_s_mean": "E2E mean, per-pass sims",
    "own_err_tpot_s_mean": "TPOT mean, own speed",
    "own_err_e2e_s_mean": "E2E mean, own speed",
    "own_err_ttft_s_p50": "TTFT p50, own speed",
    "win_err_tpot_s_mean": "TPOT mean, run's speed by window",
    "win_err_e2e_s_mean": "E2E mean, run's speed by window",
    "win_err_ttft_s_p50": "TTFT p50, run's speed by window",
    "nb_err_tpot_s_mean": "TPOT mean, neighbours' speed",
    "nb_err_e2e_s_mean": "E2E mean, neighbours' speed",
    "nb_err_ttft_s_p50": "TTFT p50, neighbours' speed",
    "ref_err_tpot_s_mean": "TPOT mean, reference probe",
    "ref_err_e2e_s_mean": "E2E mean, reference probe",
    "ref_err_ttft_s_p50": "TTFT p50, reference probe",
    "refwin_err_tpot_s_mean": "TPOT mean, reference probe by window",
    "refwin_err_e2e_s_mean": "E2E mean, reference probe by window",
    "refwin_err_ttft_s_p50": "TTFT p50, reference probe by window",
}


def markdown_cell(column: str, value: float) -> str:
    """A correlation as is, a fraction in percent, an error in signed percent."""
    if pd.isna(value):
        return ""
    if column == "e2e_corr":
        return f"{value:.3f}"
    return f"{value:.1%}" if column == "real_queued_steps" else f"{value:+.1%}"


def errors_markdown(table: pd.DataFrame) -> str:
    """The summary as a Markdown table: errors in percent, blank where not measured."""
    cols = [c for c in MARKDOWN if c in table.columns]
    rows = [
        [r["trace"], r["policy"], *(markdown_cell(c, r[c]) for c in cols)]
        for _, r in table.iterrows()
    ]
    return markdown_table(["trace", "policy", *(MARKDOWN[c] for c in cols)], rows, left=2)


def sizes_markdown(sizes: pd.DataFrame, least: float = 0.005) -> str:
    """The steps by batch composition as Markdown, leaving out compositions under
    ``least`` of a trace's busy time."""
    if sizes.empty:
        return ""
    columns = ["trace", "step", "requests", "steps", "busy time", "model error"]
    rows = [
        [r["trace"], r["step"], str(r["num_reqs"]), str(r["steps"]), f"{r['busy_share']:.1%}"]
        + [f"{r['err']:+.1%}", f"{r['err_vs_trace']:+.1%}"]
        for _, r in sizes[sizes["busy_share"] >= least].iterrows()
    ]
    return markdown_table([*columns, "beside the trace's"], rows, left=2)


def speeds_markdown(summary: pd.DataFrame) -> str:
    """The machine's steadiness per trace as Markdown."""
    columns = ["trace", "real runs", "own speed, lowest", "highest", "spread (CV)"]
    columns += ["change, run to run", f"within a run ({WINDOW_S:.0f} s stretches, CV)"]
    rows = [
        [r["trace"], str(r["runs"]), f"{r['own_min']:.3f}", f"{r['own_max']:.3f}"]
        + [f"{r['own_cv']:.1%}", f"{r['adjacent_change']:.1%}", f"{r['within_run_cv']:.1%}"]
        for _, r in summary.iterrows()
    ]
    if "reference_rms" in summary:  # the reference probe against the runs' own speed
        columns += ["reference / own speed - 1, rms: per run", f"per {WINDOW_S:.0f} s"]
        for row, (_, r) in zip(rows, summary.iterrows(), strict=True):
            row += [f"{r['reference_rms']:.1%}", f"{r['reference_window_rms']:.1%}"]
    return markdown_table(columns, rows, left=1)


def effects_markdown(effects: pd.DataFrame, orders: pd.DataFrame) -> str:
    """The policy effects as Markdown: sim and real side by side, and the orders."""
    if effects.empty:
        return ""
    own = "own_effect_min" in effects.columns
    win = "win_effect" in effects.columns
    columns = ["trace", "metric", "policy", "sim effect", "real effect", "real, round by round"]
    if win:
        columns.insert(4, "sim at the runs' speed by window")
    if own:
        columns += ["sim at each run's speed, round by round", "largest gap in a round"]
    rows = []
    for _, r in effects.iterrows():
        row = [r["trace"], r["metric"], r["policy"], f"{r['sim_effect']:+.1%}"]
        if win:
            row += ["" if pd.isna(r["win_effect"]) else f"{r['win_effect']:+.1%}"]
        row += [
            f"{r['real_effect']:+.1%}",
            f"{r['real_effect_min']:+.1%} .. {r['real_effect_max']:+.1%}",
        ]
        if own and not pd.isna(r["own_effect_min"]):
            row += [f"{r['own_effect_min']:+.1%} .. {r['own_effect_max']:+.1%}"]
            row += [f"{r['own_round_gap']:.1%}"]
        elif own:
            row += ["", ""]
        rows.append(row)
    return effects_md_with_orders(markdown_table(columns, rows, left=3), orders)


def effects_md_with_orders(effects_md: str, orders: pd.DataFrame) -> str:
    """The effects' Markdown followed by the orders' table."""
    win = "win_pairs_ordered_alike" in orders.columns
    rows = [
        [r["trace"], r["metric"], r["sim_order"], r["real_order"]]
        + [f"{r['pairs_ordered_alike']} / {r['pairs']}"]
        + ([f"{r['win_pairs_ordered_alike']:.0f} / {r['pairs']}"] if win else [])
        for _, r in orders.iterrows()
    ]
    columns = ["trace", "metric", "sim order", "real order", "pairs alike"]
    columns += ["alike at the runs' speed by window"] if win else []
    return effects_md + "\n" + markdown_table(columns, rows, left=4)


def latency_summary(row: dict, prefix: str = "") -> str:
    """Mean TPOT, mean E2E and p50 TTFT errors of a row's ``<prefix>err_*``."""
    return (
        f"TPOT mean {row[f'{prefix}err_tpot_s_mean']:+.1%}, "
        f"E2E mean {row[f'{prefix}err_e2e_s_mean']:+.1%}, "
        f"TTFT p50 {row[f'{prefix}err_ttft_s_p50']:+.1%}"
    )


def repeats_line(row: dict, runs: int) -> str:
    """The simulation against the mean of ``runs`` real runs and each alone."""
    return (
        f"    against the mean of {runs} real runs, which spread "
        f"{row['real_spread_tpot_s_mean']:.1%} in TPOT mean; against each alone: "
        f"TPOT mean {row['err_min_tpot_s_mean']:+.1%} to "
        f"{row['err_max_tpot_s_mean']:+.1%}; each at its own speed: "
        f"TPOT mean {row['own_each_err_min_tpot_s_mean']:+.1%} to "
        f"{row['own_each_err_max_tpot_s_mean']:+.1%}, E2E mean "
        f"{row['own_each_err_min_e2e_s_mean']:+.1%} to "
        f"{row['own_each_err_max_e2e_s_mean']:+.1%}"
    )


def pair_lines(row: dict, runs: int, passes: int) -> list[str]:
    """What the console says about one pair: the prediction, then each variant."""
    lines = [
        f"  {row['policy']}: throughput {row['err_throughput_req_s']:+.1%}, "
        f"{latency_summary(row)}, E2E corr {row['e2e_corr']:.3f}; "
        f"real steps predicted {row['step_err_total']:+.1%} (busy time), "
        f"{row['step_err_per_request']:+.1%} (per request), "
        f"{row['step_err_median']:+.1%} (median step)"
    ]
    if runs > 1:
        lines.append(repeats_line(row, runs))
    if passes > 1:
        per_pass = latency_summary(row, "pass_")
        lines.append(f"    mean of {passes} simulations, one per profiler pass: {per_pass}")
    scaled = [
        ("own_speed_factor", "own_", "at the run's own speed"),
        (None, "win_", f"at the run's speed by {TRACE_WINDOW_S:g} s window"),
        ("neighbour_speed_factor", "nb_", "at the neighbouring runs' speed"),
        ("reference_speed_factor", "ref_", "at the reference probe's speed"),
        (None, "refwin_", f"at the reference probe's speed by {TRACE_WINDOW_S:g} s window"),
    ]
    for factor, prefix, what in scaled:
        if f"{prefix}err_tpot_s_mean" in row:
            times = f" (x{row[factor]:.3f})" if factor else ""
            lines.append(f"    {what}{times}: " + latency_summary(row, prefix))
    return lines


def plot(pairs: list[tuple[str, Path, Path]], path: Path) -> None:
    """CDF overlays of TTFT, TPOT and E2E and a per-request E2E scatter, a row per pair."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(pairs), 4, figsize=(16, 3.2 * len(pairs)), squeeze=False)
    for row, (label, sim_dir, real_dir) in zip(axes, pairs, strict=True):
        rs, rr = (pd.read_csv(d / "requests.csv") for d in (sim_dir, real_dir))
        for ax, col in zip(row[:3], LATENCIES, strict=True):
            for df, name in ((rr, "real"), (rs, "sim")):
                v = np.sort(df[col].dropna().to_numpy())
                ax.plot(v, np.arange(1, v.size + 1) / max(v.size, 1), label=name)
            ax.set(xlabel=col, title=f"{label}: {col} CDF")
            ax.legend()
            ax.grid(alpha=0.3)
        j = join_requests(rs, rr, "e2e_s", f"{sim_dir} and {real_dir}")
        ax = row[3]
        ax.scatter(j["e2e_s_real"], j["e2e_s_sim"], s=6)
        hi = float(max(j.max().max(), 1e-3))
        ax.plot([0, hi], [0, hi], color="gray", lw=1)
        ax.set(xlabel="real E2E (s)", ylabel="sim E2E (s)", title=f"{label}: per request")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def fidelity_markdown(
    table: pd.DataFrame, tables: dict, mismatches: list[str], baseline: str
) -> str:
    """``fidelity.md``: machine warnings, the errors, the policy effects against
    ``baseline``, the steps by batch and the machine's speed run by run."""
    effects_md = effects_markdown(tables["policy_effects"], tables["policy_orders"])
    sizes_md = sizes_markdown(tables["steps_by_size"])
    return (
        "".join(f"{line}\n\n" for line in mismatches)
        + errors_markdown(table)
        + (f"\n## Policy effects against {baseline}\n\n" + effects_md if effects_md else "")
        + ("\n## The latency model on the real steps, by batch\n\n" + sizes_md if sizes_md else "")
        + "\n## The machine's speed, run by run\n\n"
        + speeds_markdown(tables["speed_summary"])
    )


def write_tables(
    out: Path, rows: list[dict], tables: dict[str, pd.DataFrame], meta: dict, markdown: str
) -> None:
    """The pairs' ``rows`` as ``fidelity.csv``, every other table as ``<name>.csv``
    (but ``speed_summary``, which ``fidelity.md`` shows), ``fidelity.md``, and all
    of them with ``meta`` in ``fidelity.json``."""
    pd.DataFrame(rows).to_csv(out / "fidelity.csv", index=False, float_format="%.6g")
    for name, table in tables.items():
        if name != "speed_summary":
            fmt = None if name == "policy_orders" else "%.6g"  # counts and orders only
            table.to_csv(out / f"{name}.csv", index=False, float_format=fmt)
    (out / "fidelity.md").write_text(markdown)
    records = {name: t.to_dict("records") for name, t in tables.items()}
    (out / "fidelity.json").write_text(
        json.dumps(dict(meta=meta, rows=rows, **records), indent=2) + "\n"
    )
