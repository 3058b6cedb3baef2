"""Sim-vs-real fidelity: the same trace, policy and engine in both modes, request by request.

For each trace and policy it runs ``mode=sim`` (the latency model of this
hardware and model: the measured profile where one exists) and ``mode=real``
(the real engine on the wall clock), joins the two ``requests.csv`` on the
request id, and reports the relative error of the simulation (sim / real - 1)
on throughput and on the mean, p50, p90 and p99 of TTFT, TPOT and E2E, plus
the per-request correlation of E2E. It also predicts every step the real run
measured from that step's composition (``step_err_*``): the latency model's own
error, apart from any difference in schedule. It writes the table (CSV, JSON), plots
(CDF overlays and a sim-vs-real scatter of E2E per request) and logs both to W&B.

Each trace is scaled to ``--load`` (default 70%) of the engine's capacity: the
highest rate it sustains, which the simulator finds first by bisection. With
``--noise`` each trace's first real run is repeated, and the difference between
the two real runs (the machine's own noise floor) is reported beside the errors; with
``--profile-first`` the simulator uses a profile measured just before the runs.

On a machine whose speed wanders over minutes (a shared VM: 5-10%), one real
run and one profile are each a sample of that wander. ``--repeats R`` runs every
pair R times, in rounds (each policy once per round, so a pair's repeats lie
far apart; every other round in reverse, so that a steady drift cancels over
an even R: :func:`rounds`), and compares the simulation with their mean (``average_runs``),
reporting their spread and the error against each run alone;
``--profile-passes K`` measures the profile in K passes spread evenly over the
real runs (the first before them, sets the rates; the last after them) and
simulates with all of them merged (``merge_profiles``): the machine's speed
averaged over the experiment's window, not a few minutes before it. With two
passes or more each pair is also simulated once per pass and those metrics
averaged (``pass_err_*``): a burst amplifies a slow spell more than a fast one
shortens it, so the mean over sampled speeds exceeds the simulation at the
mean speed.

Each pair is also simulated at the real run's own speed: every step scaled by
the ratio of the real run's busy time to the latency model's prediction of the
same steps (``own_err_*``). That is calibrated on the run itself, so it is not
a prediction; it is the simulator's error apart from how much faster or slower
the machine ran than when it was profiled (on a shared VM, 5-10% within
minutes). ``--reuse RUNS_DIR`` takes the real runs (and the profile) of an
earlier invocation and re-simulates only: a change to the simulator or the
latency model is checked against the same real runs in seconds.

Each pair is also simulated at its neighbours' speed (``nb_err_*``): every
step scaled by the mean own speed of the nearest real runs of the same trace and
other policies, two before and two after each of the pair's runs
(:func:`neighbour_speeds`). It is calibrated on the real engine's step records,
but never on the pair's own: a simulator kept calibrated by the engine's recent
runs of other policies, predicting this one. On the 2-core VM the machine's
speed wanders by several percent between minutes-apart measurements, which a
profile taken at another time cannot follow but runs minutes away mostly do.

With ``--speed-probe`` the machine's speed is measured (a few seconds of fixed
steps, ``testbed.profiling.probes.speed_probe``) right before and after each
real run and compared with the same probe recorded in the profile; each pair
is then also simulated with every step scaled by that ratio, and both errors
are reported: as profiled (``err_*``) and probe-corrected (``cor_err_*``). On
the 2-core VM a few seconds of probe did not follow the drift over a run
(experiments/results/fidelity_cpu/); the run's own speed above does.

With ``--idle-probe`` each real run samples the machine's speed in its idle gaps
(``mode.idle_probe=true``: one fixed decode step on the run's model, every
quarter second while the next arrival is at least 50 ms away, never beside a
step; ``testbed.profiling.probes.IdleProbe``), and the profiler records the
same probe. Each pair is also simulated with every step scaled by the ratio of
the run's median sample to the profile's (``idle_err_*``): the simulator given
the machine's speed during the run, measured apart from the run's own steps.

Every real run and profiler pass runs in a fresh Python process
(:func:`run_isolated`; ``--in-process`` for the script's own): no run inherits
what earlier runs and simulations left in the process (as separate
invocations would not).

What a researcher reads off the simulator is how the policies compare, so the
script also writes the policy effects (``policy_effects.csv``,
``policy_orders.csv`` and a section of ``fidelity.md``): for each trace and
metric, every policy against the first one (policy / first - 1) in simulation
and in the real runs, with the real effect round by round as its noise, and how
many pairs of policies simulation and real runs order alike. With repeats,
each real run is also simulated at its own speed, so that the machine's speed
in each run can be told from the simulator (``own_each_err_*``,
``own_effect_*``). Policies differ
only where requests wait and, for priority and vtc, where the trace has
classes and tenants (``trace.priority_classes``, ``trace.num_tenants``).

Where the latency model's shape misses, apart from the machine's speed, is in
``steps_by_size.csv`` (and a section of ``fidelity.md``): the model on all of a
trace's real steps by batch composition (:func:`steps_by_size`). How steady the
machine was is in ``run_speeds.csv`` (and the last section of ``fidelity.md``):
every real run in the order it ran, with its own and its neighbours' speed and
its speed over 60-second stretches (:func:`window_speeds`, :func:`speed_summary`).

    python experiments/fidelity.py --policies fcfs sjf priority vtc \\
        --traces azure_conv mooncake_conv:prompt_scale=0.0625 --num-requests 200

A trace given as ``name:option=value,...`` gets those trace options alone (the
Mooncake prompts average 12k tokens: scaled by 1/16, with their hash blocks,
they fit the default model's 2,048-token context and keep their sharing).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hydra import compose, initialize_config_dir  # noqa: E402

from testbed.build import engine_args, latency_model, model_spec, run_trace  # noqa: E402
from testbed.capacity import find_capacity  # noqa: E402
from testbed.job import run_from_config  # noqa: E402
from testbed.modes.real import engine_model  # noqa: E402
from testbed.profile_table import merge_profiles, profile_machine  # noqa: E402
from testbed.profiling.fit_report import fit_line  # noqa: E402
from testbed.profiling.probes import probe_engine, speed_probe  # noqa: E402
from testbed.profiling.reference_probe import (  # noqa: E402
    beside_busy,
    reference_key,
)
from testbed.report.wandb_log import log_experiment  # noqa: E402
from testbed.signals import interrupt_on_sigterm  # noqa: E402
from testbed.sim.run_speed import SPEED_WINDOW_S, predict_logged_steps, speed_by_window  # noqa: E402
from testbed.sim.speed import SpeedTrace  # noqa: E402
from traces.transforms import mean_rate  # noqa: E402

STATS = ("mean", "p50", "p90", "p99")
LATENCIES = ("ttft_s", "tpot_s", "e2e_s")
NOISE = " (real vs real)"  # the policy column of a real run against its repeat


def read_experiment(path: Path) -> tuple[dict, pd.DataFrame]:
    """An experiment's ``meta`` (from ``fidelity.json``) and its table (``fidelity.csv``)."""
    files = {name: path / name for name in ("fidelity.json", "fidelity.csv")}
    for name, file in files.items():
        if not file.is_file():
            raise SystemExit(f"{path}: no {name} (the --out directory of experiments/fidelity.py)")
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


def compose_cfg(overrides: list[str]):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose("config", overrides=overrides)


def _run_child(overrides: list[str], run_dir: Path | None) -> None:
    """:func:`run_isolated`'s process: Ctrl-C is its parent's to forward (as
    SIGTERM, which stops the run the way Ctrl-C would)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    interrupt_on_sigterm()
    run_from_config(compose_cfg(overrides), run_dir)


def run_isolated(overrides: list[str], run_dir: Path | None = None) -> None:
    """``run_from_config(compose_cfg(overrides), run_dir)`` in a fresh Python
    process, so that no run inherits an earlier one's state (heap, caches, the
    simulations between them), as separate invocations would not. Whether that
    state slows later runs is unsettled on the 2-core VM: of two checks
    (experiments/process_state.py), one found a process's later real runs 3.7%
    slower against the reference probe than fresh ones, the other 3.1% faster.
    Interrupted (Ctrl-C, SIGTERM), the run is stopped and writes what it
    measured (partial), as in-process."""
    proc = multiprocessing.get_context("spawn").Process(
        target=_run_child, args=(overrides, run_dir)
    )
    proc.start()
    try:
        proc.join()
    except KeyboardInterrupt:
        proc.terminate()
        proc.join()
        if run_dir is None or not (run_dir / "metrics.json").exists():
            raise
        return
    if proc.exitcode != 0:
        where = run_dir or "the profiler pass"
        raise RuntimeError(f"{where} failed in its own process (exit code {proc.exitcode})")


def simulate(overrides: list[str], run_dir: Path, scale: float = 1.0) -> Path:
    """The simulation of ``overrides``, every step scaled by ``scale``."""
    scaled = [f"mode.latency_scale={scale:.6f}"] if scale != 1.0 else []
    run_from_config(compose_cfg([*overrides, "mode=sim", *scaled]), run_dir)
    return run_dir


def read_metrics(run_dir: Path) -> dict:
    """A run's ``metrics.json``."""
    return json.loads((run_dir / "metrics.json").read_text())


def simulated_with(run_dir: Path) -> str | None:
    """The latency model a simulation ran with (its ``latency_model_source``)."""
    return read_metrics(run_dir).get("latency_model_source")


def reuse_warning(reused_sim: Path, sim: Path) -> str | None:
    """Where the reused invocation simulated a pair with another latency model (a
    profile measured again, or passes added) than this one: a warning that names
    both, since the tables will differ from that invocation's; else None."""
    if not (reused_sim / "metrics.json").exists():
        return None
    was, now = simulated_with(reused_sim), simulated_with(sim)
    if was == now:
        return None
    return (
        f"WARNING --reuse: {reused_sim} was simulated with {was}; this simulation "
        f"with {now}: the tables differ from that invocation's for the model, not the runs"
    )


def machine_mismatches(pairs: list[tuple[Path, object]]) -> list[str]:
    """A warning line for each real run measured on another machine than the
    profile its pair was simulated with (``machine`` in the run's
    ``metrics.json`` against the profile header's; see
    :func:`~testbed.profile_table.profile_machine`): a profile from an
    AVX-512 VM predicted an AVX2 one's steps 1.6-2.7x too fast (2026-12-02),
    which no speed factor of this script should be asked to hide. Runs or
    profiles that do not record the machine are not compared."""
    lines = []
    for run, model in pairs:
        ran_on = read_metrics(run).get("machine")
        profiled_on = profile_machine(getattr(model, "header", {}))
        if ran_on and profiled_on and ran_on != profiled_on:
            lines.append(
                f"WARNING: {run.parent.name}/{run.name} ran on {ran_on}; its latency model "
                f"({getattr(model, 'source', '?')}) was profiled on {profiled_on}"
            )
    return lines


def capacity(common: list[str]) -> float:
    """The highest arrival rate the engine sustains on this trace, in simulation
    (``testbed.capacity``, what ``python run.py load=...`` scales a trace by)."""
    cfg = compose_cfg([*common, "mode=sim"])
    return find_capacity(cfg, model_spec(cfg.model), start_rate=mean_rate(run_trace(cfg)))


def compare(sim_dir: Path, real_dir: Path) -> dict:
    """Relative errors of the simulation against the real run."""
    ms = read_metrics(sim_dir)
    mr = read_metrics(real_dir)
    row: dict = {}
    for k in ("throughput_req_s", "throughput_output_tok_s"):
        row[f"err_{k}"] = ms[k] / mr[k] - 1
    for lat in LATENCIES:
        for s in STATS:
            key = f"{lat}_{s}"
            row[f"sim_{key}"], row[f"real_{key}"] = ms[key], mr[key]
            row[f"err_{key}"] = ms[key] / mr[key] - 1 if mr[key] else float("nan")
    rs = pd.read_csv(sim_dir / "requests.csv").set_index("request_id")
    rr = pd.read_csv(real_dir / "requests.csv").set_index("request_id")
    arrivals = rs[["arrival_s"]].join(rr[["arrival_s"]].add_suffix("_real"), how="outer")
    if not np.allclose(arrivals["arrival_s"], arrivals["arrival_s_real"], atol=1e-6):
        raise ValueError(f"{sim_dir} and {real_dir} did not replay the same arrivals")
    both = rs[["e2e_s"]].join(rr[["e2e_s"]], suffixes=("_sim", "_real")).dropna()
    row["e2e_corr"] = float(np.corrcoef(both["e2e_s_sim"], both["e2e_s_real"])[0, 1])
    row["joined_requests"] = len(both)
    return row


def prefixed_errors(sim_dir: Path, real_dir: Path, prefix: str) -> dict:
    """The relative errors of :func:`compare`, named ``<prefix>_err_*``: for a
    second simulation of a pair beside the prediction."""
    errors = compare(sim_dir, real_dir)
    return {f"{prefix}_{k}": v for k, v in errors.items() if k.startswith("err_")}


def scaled_errors(overrides: list[str], run_dir: Path, real: Path, scale: float, prefix: str):
    """The errors (``<prefix>_err_*``) of a simulation with every step scaled by
    ``scale`` against the real run ``real``."""
    return prefixed_errors(simulate(overrides, run_dir, scale), real, prefix)


def latency_summary(row: dict, prefix: str = "") -> str:
    """Mean TPOT, mean E2E and p50 TTFT errors of a row's ``<prefix>err_*``."""
    return (
        f"TPOT mean {row[f'{prefix}err_tpot_s_mean']:+.1%}, "
        f"E2E mean {row[f'{prefix}err_e2e_s_mean']:+.1%}, "
        f"TTFT p50 {row[f'{prefix}err_ttft_s_p50']:+.1%}"
    )


# steps.csv columns that busy_steps reads (the latency model's features among them)
STEP_COLUMNS = ("start_s", "latency_s", "num_reqs", "num_prefill_tokens", "num_decode_tokens",
                "attn_pairs", "kv_tokens", "max_kv")  # fmt: skip


def busy_steps(run_dir: Path, model) -> pd.DataFrame:
    """A run's ``steps.csv`` without its idle rows, with the latency model's
    prediction of each step (``pred_s``) and the idle time before it since the
    last busy step ended (``gap_s``: 0 back to back, the wait for an arrival)."""
    path = run_dir / "steps.csv"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: no steps.csv (not a real run directory)")
    steps = pd.read_csv(path)
    missing = sorted(set(STEP_COLUMNS) - set(steps.columns))
    if missing:
        raise ValueError(f"{path}: no column(s) {missing}")
    busy = steps["num_reqs"] > 0
    ends = (steps["start_s"] + steps["latency_s"]).where(busy).ffill().shift(1)
    steps = steps.assign(gap_s=(steps["start_s"] - ends).fillna(0.0).clip(lower=0.0))[busy]
    return steps.assign(pred_s=predict_logged_steps(model, steps))


def error_ratio(err: float, base: float) -> float:
    """One relative error against another, (1 + err) / (1 + base) - 1: what is
    left of ``err`` once the error both share (the machine's speed) is taken out."""
    return (1 + err) / (1 + base) - 1


def step_errors(steps: pd.DataFrame) -> dict:
    """The latency model against the real run's own steps: each measured step's
    composition predicted (sim / real - 1), free of any difference in schedule.
    ``total``: the summed busy time; ``median``: the typical step;
    ``per_request``: each step counted once per request in its batch, as the
    requests' latencies add it up (what mean TPOT and E2E average: a large batch
    weighs as much as the requests that wait on it); split into steps with a
    prefill chunk and plain decode steps. ``steps``: a run's :func:`busy_steps`
    (or several runs' together)."""
    pred = steps["pred_s"].to_numpy(float)
    real = steps["latency_s"].to_numpy(float)
    row = {
        "step_err_total": float(pred.sum() / real.sum() - 1),
        "step_err_median": float(np.median(pred / real) - 1),
    }
    reqs = steps["num_reqs"].to_numpy(float)
    row["step_err_per_request"] = float((reqs * pred).sum() / (reqs * real).sum() - 1)
    prefill = steps["num_prefill_tokens"].to_numpy() > 0
    for name, mask in (("prefill", prefill), ("decode", ~prefill)):
        if mask.any():
            row[f"step_err_{name}_total"] = float(pred[mask].sum() / real[mask].sum() - 1)
    return row


def size_bucket(num_reqs: int) -> int:
    """A batch size as :func:`steps_by_size` groups it: each size up to 16, then
    the power of two at or above it."""
    return num_reqs if num_reqs <= 16 else 1 << (num_reqs - 1).bit_length()


def size_label(bucket: int) -> str:
    return str(bucket) if bucket <= 16 else f"{bucket // 2 + 1}-{bucket}"


def steps_by_size(runs: dict[str, list[pd.DataFrame]]) -> pd.DataFrame:
    """The latency model on the real runs' own steps, by batch composition: for
    each trace (the :func:`busy_steps` of all its real runs), decode-only steps
    and steps with a prefill chunk, by the number of requests in the batch; their
    share of the busy time and the model's error on them (predicted / real - 1).
    ``err_vs_trace`` divides out the trace's overall error, which the machine's
    speed sets: what is left is where the model's shape misses."""
    rows = []
    for trace, frames in runs.items():
        if not frames:
            continue
        steps = pd.concat(frames)
        busy = steps["latency_s"].sum()
        level = steps["pred_s"].sum() / busy
        kind = np.where(steps["num_prefill_tokens"] > 0, "with prefill", "decode only")
        bucket = steps["num_reqs"].astype(int).map(size_bucket)
        for (k, b), g in steps.groupby([kind, bucket]):
            err = g["pred_s"].sum() / g["latency_s"].sum()
            rows.append(
                dict(
                    trace=trace,
                    step=k,
                    num_reqs=size_label(int(b)),
                    steps=len(g),
                    busy_share=g["latency_s"].sum() / busy,
                    err=err - 1,
                    err_vs_trace=err / level - 1,
                )
            )
    return pd.DataFrame(rows)


def markdown_table(columns: list[str], rows: list[list[str]], left: int) -> str:
    """A Markdown table: the first ``left`` columns aligned left, the rest (numbers)
    right."""
    align = ["---"] * left + ["---:"] * (len(columns) - left)
    lines = [columns, align, *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines) + "\n"


def sizes_markdown(sizes: pd.DataFrame, least: float = 0.005) -> str:
    """:func:`steps_by_size` as Markdown, leaving out compositions under ``least``
    of a trace's busy time."""
    if sizes.empty:
        return ""
    columns = ["trace", "step", "requests", "steps", "busy time", "model error"]
    rows = [
        [r["trace"], r["step"], str(r["num_reqs"]), str(r["steps"]), f"{r['busy_share']:.1%}"]
        + [f"{r['err']:+.1%}", f"{r['err_vs_trace']:+.1%}"]
        for _, r in sizes[sizes["busy_share"] >= least].iterrows()
    ]
    return markdown_table([*columns, "beside the trace's"], rows, left=2)


def own_speed(steps: dict) -> float:
    """The factor that scales the latency model to a real run's own speed: its
    busy time over the model's prediction of the same steps (from
    :func:`step_errors`)."""
    return 1 / (1 + steps["step_err_total"])


NEIGHBOURS = 2  # runs on each side that :func:`neighbour_speeds` averages


def neighbour_speeds(
    ran: list[tuple[str, str]], speeds: list[float], width: int = NEIGHBOURS
) -> list[float]:
    """For each real run, in the order the runs ran (``ran``: each run's trace
    and policy; ``speeds``: each run's :func:`own_speed`), the machine's speed
    from its neighbours: the mean own speed of the ``width`` nearest runs of the
    same trace and another policy before it and the ``width`` nearest after it
    (fewer at the ends). The pair's own runs are left out, so the factor is a
    measurement of the machine around the run, not of the run: what a
    simulator calibrated on the real engine's recent step records (of other
    policies, on the same workload) would use. NaN where there is no such run."""
    out = []
    for i, (trace, policy) in enumerate(ran):
        others = [j for j, (t, p) in enumerate(ran) if t == trace and p != policy]
        before = [speeds[j] for j in reversed(others) if j < i][:width]
        after = [speeds[j] for j in others if j > i][:width]
        near = before + after
        out.append(float(np.mean(near)) if near else float("nan"))
    return out


WINDOW_S = SPEED_WINDOW_S  # the stretches of a run that :func:`window_speeds` measures
TRACE_WINDOW_S = 10.0  # the windows of a run's :func:`run_speed_trace`


def windows(steps: pd.DataFrame, width_s: float) -> pd.Series:
    """A real run's speed stretch by stretch: for each ``width_s`` seconds of its
    clock (by when a step starts; indexed by the stretch's number from 0), the
    busy time of those steps over the latency model's prediction of them, as
    :func:`own_speed` is for the whole run. ``steps``: the run's
    :func:`busy_steps`; stretches without a step are left out."""
    return speed_by_window(steps["start_s"], steps["latency_s"], steps["pred_s"], width_s)["speed"]


def window_speeds(steps: pd.DataFrame, width_s: float = WINDOW_S) -> np.ndarray:
    """The speeds of a run's :func:`windows` of ``width_s`` seconds, in order."""
    return windows(steps, width_s).to_numpy(float)


def run_speed_trace(steps: pd.DataFrame, width_s: float = TRACE_WINDOW_S) -> SpeedTrace:
    """A real run's speed window by window as the simulator's speed trace
    (``mode.speed_trace``): one row per ``width_s`` seconds from 0, the
    :func:`windows` speed, where no step started the previous window's (the
    first: the run's :func:`own_speed`)."""
    return window_trace(windows(steps, width_s), own_speed(step_errors(steps)), width_s)


def window_trace(speeds: pd.Series, first: float, width_s: float) -> SpeedTrace:
    """Speeds by window number (some windows missing) as a speed trace from 0: a
    missing window takes the previous one's factor, the first ``first``."""
    filled = speeds.reindex(range(int(speeds.index.max()) + 1)).ffill()
    return SpeedTrace.from_windows(width_s, filled.fillna(first).tolist())


def reference_windows(run: Path, profiled: float, width_s: float) -> pd.Series:
    """A real run's reference probe (``reference_probe.csv``) over the profile's
    (``profiled`` seconds), window by window (indexed by the window's number from
    0): the median of the samples beside the busy engine; windows without one are
    left out, as :func:`windows` leaves out those without a step."""
    busy = beside_busy(pd.read_csv(run / "reference_probe.csv"))
    return busy.groupby((busy["time_s"] // width_s).astype(int))["probe_s"].median() / profiled


def reference_speed_trace(run: Path, profiled: float, width_s: float = TRACE_WINDOW_S):
    """:func:`reference_windows` as the simulator's speed trace, as
    :func:`run_speed_trace` does with the run's own windows: where a window has no
    sample, the previous window's (the first: the run's median over the profile's,
    ``reference_probe_s`` in its metrics). None where no sample was beside a busy step."""
    speeds = reference_windows(run, profiled, width_s)
    if speeds.empty:
        return None
    return window_trace(speeds, read_metrics(run)["reference_probe_s"] / profiled, width_s)


def reference_tracking(run: Path, steps: pd.DataFrame, profiled: float) -> dict:
    """How closely a run's reference probe followed its own speed: the run's
    factor (``reference_probe_s`` over the profile's :func:`profile_reference`)
    and the rms of reference over own speed - 1 across its :data:`WINDOW_S`
    windows (``steps``: its :func:`busy_steps`). Empty without a reference."""
    if not (run / "reference_probe.csv").exists() or not np.isfinite(profiled):
        return {}
    ref = reference_windows(run, profiled, WINDOW_S)
    both = pd.concat([ref, windows(steps, WINDOW_S)], axis=1, keys=["ref", "own"]).dropna()
    rms = float(np.sqrt(((both["ref"] / both["own"] - 1) ** 2).mean())) if len(both) else np.nan
    return dict(
        reference_speed=read_metrics(run).get("reference_probe_s", np.nan) / profiled,
        reference_window_rms=rms,
    )


def cv(values: np.ndarray) -> float:
    """The coefficient of variation (standard deviation over mean); NaN when empty."""
    return float(values.std() / values.mean()) if len(values) else float("nan")


def run_speeds(
    ran: list[tuple[str, str, Path]],
    predicted: dict,
    own: dict,
    around: dict,
    profiled: dict | None = None,
):
    """``run_speeds.csv``: every real run (``ran``: trace, policy, folder) in the
    order it ran, with its :func:`own_speed`, its :func:`neighbour_speeds`, the
    :func:`cv` of its :func:`window_speeds` (``predicted``: each run's
    :func:`busy_steps`; ``own``, ``around``: each run's speeds) and, where it ran
    with the reference probe, :func:`reference_tracking` (``profiled``: the
    profile's :func:`profile_reference` per run)."""
    profiled = profiled or {}
    rows = []
    for i, (trace, policy, run) in enumerate(ran):
        stretches = window_speeds(predicted[run])
        rows.append(
            dict(
                order=i + 1,
                trace=trace,
                policy=policy,
                run=run.name,
                own_speed=own[run],
                neighbours_speed=around[run],
                windows=len(stretches),
                window_cv=cv(stretches),
                **reference_tracking(run, predicted[run], profiled.get(run, np.nan)),
            )
        )
    return pd.DataFrame(rows)


def speed_summary(speeds: pd.DataFrame) -> pd.DataFrame:
    """How steady the machine was, per trace, from ``run_speeds.csv`` (one row per
    real run, in the order they ran): the runs' own speeds (lowest, highest, their
    coefficient of variation), the mean change from one run of the trace to the
    next, and the mean coefficient of variation of a run's :func:`window_speeds`."""
    rows = []
    for trace, g in speeds.groupby("trace", sort=False):
        own = g.sort_values("order")["own_speed"].to_numpy(float)
        change = np.abs(np.diff(own)).mean() / own.mean() if len(own) > 1 else np.nan
        row = dict(
            trace=trace,
            runs=len(own),
            own_min=own.min(),
            own_max=own.max(),
            own_cv=cv(own),
            adjacent_change=change,
            within_run_cv=g["window_cv"].mean(),
        )
        if "reference_speed" in g and g["reference_speed"].notna().any():
            ratio = g["reference_speed"] / g["own_speed"] - 1
            row.update(
                reference_rms=float(np.sqrt((ratio**2).mean())),
                reference_window_rms=g["reference_window_rms"].mean(),
            )
        rows.append(row)
    return pd.DataFrame(rows)


def speeds_markdown(summary: pd.DataFrame) -> str:
    """:func:`speed_summary` as Markdown."""
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


def queued_steps(run_dir: Path) -> float:
    """The fraction of a run's steps with a request waiting: where the policy
    chooses anything. With none, every policy runs the same schedule and their
    rows differ only by the real runs' noise."""
    waiting = pd.read_csv(run_dir / "steps.csv", usecols=["num_waiting"])["num_waiting"]
    return float((waiting > 0).mean()) if len(waiting) else float("nan")


def profile_reference_key(model) -> str:
    """The profile header's reference probe that runs are scaled against: the
    median during its replay, whose steps set the latency model's level, where
    the header has it (:func:`~testbed.profiling.reference_probe.reference_key`).
    ``fidelity.json`` lists the keys used (``meta.profile_reference``)."""
    return reference_key(getattr(model, "header", {}))


def profile_reference(model) -> float:
    """The profile's :func:`profile_reference_key` probe, in seconds."""
    return profile_probe(model, profile_reference_key(model), "hardware.reference_cpus")


def profile_probe(model, key: str = "speed_probe_s", option: str = "--speed-probe") -> float:
    """A probe (``speed_probe_s`` or ``idle_probe_s``) recorded in the profile of
    the simulator's latency model."""
    value = getattr(model, "header", {}).get(key)
    if value is None:
        raise SystemExit(
            f"{option}: the simulator's latency model ({model.source}) records no "
            f"{key}; profile again (python run.py mode=profile) or use --profile-passes"
        )
    return float(value.split()[0])


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
    "idle_err_tpot_s_mean": "TPOT mean, idle-probe speed",
    "idle_err_e2e_s_mean": "E2E mean, idle-probe speed",
    "idle_err_ttft_s_p50": "TTFT p50, idle-probe speed",
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


def markdown(table: pd.DataFrame) -> str:
    """The summary as a Markdown table: errors in percent, blank where not measured."""
    cols = [c for c in MARKDOWN if c in table.columns]
    rows = [
        [r["trace"], r["policy"], *(markdown_cell(c, r[c]) for c in cols)]
        for _, r in table.iterrows()
    ]
    return markdown_table(["trace", "policy", *(MARKDOWN[c] for c in cols)], rows, left=2)


def plot(pairs: list[tuple[str, Path, Path]], path: Path) -> None:
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
        j = (
            rs.set_index("request_id")[["e2e_s"]]
            .join(rr.set_index("request_id")[["e2e_s"]], suffixes=("_sim", "_real"))
            .dropna()
        )
        ax = row[3]
        ax.scatter(j["e2e_s_real"], j["e2e_s_sim"], s=6)
        hi = float(max(j.max().max(), 1e-3))
        ax.plot([0, hi], [0, hi], color="gray", lw=1)
        ax.set(xlabel="real E2E (s)", ylabel="sim E2E (s)", title=f"{label}: per request")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def average_runs(reals: list[Path], out: Path) -> Path:
    """Several runs of one pair (real runs, or simulations) as one run folder:
    every numeric metric the mean of the runs' (so a p50 is the mean of their
    p50s), every request's numeric columns the mean of its runs, and all their
    steps, so that :func:`compare` and :func:`step_errors` read it like any run.
    On a machine whose speed wanders, the mean of repeats is what a prediction
    can match."""
    metrics = [read_metrics(r) for r in reals]
    merged = dict(metrics[0])
    for key, value in metrics[0].items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            merged[key] = float(np.mean([m[key] for m in metrics]))
    merged["averaged_runs"] = [r.name for r in reals]
    requests = [pd.read_csv(r / "requests.csv") for r in reals]
    numeric = requests[0].select_dtypes("number").columns
    mean = pd.concat(requests).groupby("request_id", sort=False)[list(numeric)].mean()
    first = requests[0].set_index("request_id")
    first[list(numeric)] = mean.loc[first.index, list(numeric)]
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(merged, indent=2) + "\n")
    first.reset_index().to_csv(out / "requests.csv", index=False)
    steps = pd.concat([pd.read_csv(r / "steps.csv").assign(run=i) for i, r in enumerate(reals)])
    steps.to_csv(out / "steps.csv", index=False)
    return out


SPREAD = ("throughput_req_s", "tpot_s_mean", "e2e_s_mean", "ttft_s_p50")


def repeat_spread(sim: Path, reals: list[Path], own: list[Path] | None = None) -> dict:
    """How far repeated real runs of one pair are apart (``real_spread_*``:
    (max - min) / mean), and the simulation's error against each of them alone
    (``err_min_*``, ``err_max_*``); with ``own`` (each run simulated at its own
    speed), those simulations' errors against their runs (``own_each_err_*``)."""
    metrics = [read_metrics(r) for r in reals]
    ms = read_metrics(sim)
    owns = [read_metrics(r) for r in own or []]
    row: dict = {"real_runs": len(reals)}
    for key in SPREAD:
        values = np.array([m[key] for m in metrics], float)
        row[f"real_spread_{key}"] = float(np.ptp(values) / values.mean())
        errors = ms[key] / values - 1
        row[f"err_min_{key}"], row[f"err_max_{key}"] = float(errors.min()), float(errors.max())
        if owns:
            each = np.array([o[key] for o in owns], float) / values - 1
            row[f"own_each_err_min_{key}"] = float(each.min())
            row[f"own_each_err_max_{key}"] = float(each.max())
    return row


EFFECTS = ("ttft_s_mean", "ttft_s_p90", "tpot_s_mean", "e2e_s_mean", "e2e_s_p90")


GROUPS = ("priority", "tenant")  # what priority and vtc order by


def metrics_of(run_dir: Path) -> dict:
    """A run's metrics, with the mean TTFT of each priority class and tenant
    (``ttft_s_mean[priority=0]``, ...) where the trace has more than one: what
    priority and vtc change, which the whole trace's means can hide."""
    metrics = read_metrics(run_dir)
    reqs = run_dir / "requests.csv"
    if reqs.exists():
        df = pd.read_csv(reqs, usecols=["ttft_s", *GROUPS])
        for group in GROUPS:
            if df[group].nunique() > 1:
                for value, ttft in df.groupby(group)["ttft_s"]:
                    metrics[f"ttft_s_mean[{group}={value}]"] = float(ttft.mean())
    return metrics


@dataclass
class PairRuns:
    """One trace and policy: its simulation, its real runs, each real run
    simulated at that run's own speed (empty with one run), and the simulation
    at the runs' speed window by window (their mean with repeats)."""

    sim: Path
    reals: list[Path]
    own: list[Path] = field(default_factory=list)
    by_window: Path | None = None


def round_effects(runs: list[dict], base: list[dict], key: str) -> list[float]:
    """Run k against the baseline's run k, for every round both have."""
    return [a[key] / b[key] - 1 for a, b in zip(runs, base, strict=False)]


def ordered_alike(values: dict, real: dict, pairs_of: list[tuple[str, str]]) -> int:
    """How many pairs of policies ``values`` order as the real runs (``real``) do."""
    same = [np.sign(values[a] - values[b]) == np.sign(real[a] - real[b]) for a, b in pairs_of]
    return int(sum(same))


def policy_effects(runs: dict[str, dict[str, PairRuns]], baseline: str):
    """What the simulator says about the policies against what the real engine
    does: for each trace and metric, each policy's effect relative to
    ``baseline`` (policy / baseline - 1) in simulation and in the real runs
    (their means; with repeats also round by round, run k against run k, as the
    real effect's noise), and how many pairs of policies the two order alike.
    With repeats, also the effect round by round between the simulations of the
    runs at their own speeds (``own_effect_*``): what the simulator says the
    machine's speed in each run did to the effect, and ``own_round_gap``, the
    largest difference from the real effect of the same round. Where every pair
    has one, the effect between the simulations at the runs' speed window by
    window (``win_effect``; ``win_pairs_ordered_alike``): the simulator given
    how the machine's speed moved in each run.

    ``runs``: trace -> policy -> :class:`PairRuns`. Returns the effects (one
    row per trace, metric and policy) and the order agreement (one row per
    trace and metric)."""
    effects, orders = [], []
    for trace, pairs in runs.items():
        if baseline not in pairs or len(pairs) < 2:
            continue
        sims = {p: metrics_of(r.sim) for p, r in pairs.items()}
        reals = {p: [metrics_of(d) for d in r.reals] for p, r in pairs.items()}
        owns = {p: [metrics_of(d) for d in r.own] for p, r in pairs.items()}
        wins = {p: metrics_of(r.by_window) for p, r in pairs.items() if r.by_window}
        if len(wins) < len(pairs):
            wins = {}
        every = [*sims.values(), *(m for ms in reals.values() for m in ms)]
        grouped = sorted(k for k in sims[baseline] if "[" in k and all(k in m for m in every))
        for key in (*EFFECTS, *grouped):
            sim_v = {p: m[key] for p, m in sims.items()}
            real_v = {p: float(np.mean([m[key] for m in ms])) for p, ms in reals.items()}
            with_win = all(key in m for m in wins.values())
            win_v = {p: m[key] for p, m in wins.items()} if with_win else {}
            for policy in pairs:
                if policy == baseline:
                    continue
                rounds = round_effects(reals[policy], reals[baseline], key)
                row = dict(
                    trace=trace,
                    metric=key,
                    policy=policy,
                    sim_effect=sim_v[policy] / sim_v[baseline] - 1,
                    real_effect=real_v[policy] / real_v[baseline] - 1,
                    real_effect_min=min(rounds),
                    real_effect_max=max(rounds),
                )
                if win_v:
                    row.update(win_effect=win_v[policy] / win_v[baseline] - 1)
                with_key = all(key in m for m in (*owns[policy], *owns[baseline]))
                own = round_effects(owns[policy], owns[baseline], key) if with_key else []
                if own:
                    gaps = [abs(o - r) for o, r in zip(own, rounds, strict=False)]
                    row.update(
                        own_effect_min=min(own), own_effect_max=max(own), own_round_gap=max(gaps)
                    )
                effects.append(row)
            names = list(pairs)
            pairs_of = [(a, b) for i, a in enumerate(names) for b in names[i + 1 :]]
            order = dict(
                trace=trace,
                metric=key,
                sim_order=" < ".join(sorted(names, key=sim_v.get)),
                real_order=" < ".join(sorted(names, key=real_v.get)),
                pairs_ordered_alike=ordered_alike(sim_v, real_v, pairs_of),
                pairs=len(pairs_of),
            )
            if win_v:
                order.update(win_pairs_ordered_alike=ordered_alike(win_v, real_v, pairs_of))
            orders.append(order)
    return pd.DataFrame(effects), pd.DataFrame(orders)


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
    effects_md = markdown_table(columns, rows, left=3)
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


def rounds(policies: list[str], repeats: int) -> list[list[str]]:
    """The order of the real runs of one trace: ``repeats`` rounds of every
    policy once, every other round reversed (fcfs sjf vtc, vtc sjf fcfs, ...).
    On a VM whose speed drifts through an experiment (by a third within an hour,
    experiments/results/fidelity_cpu1_interleaved_2/) runs in one fixed order
    give the policies the drift as effects (there the real runs ordered the
    four policies exactly as they ran); reversed rounds give each policy the
    same mean position over an even number of rounds, so a steady drift
    cancels from a pair's mean run and from the policy effects."""
    return [list(policies) if k % 2 == 0 else list(reversed(policies)) for k in range(repeats)]


def run_name(policy: str, repeat: int) -> str:
    """The folder of a pair's ``repeat``-th real run (0-based)."""
    return f"{policy}-real" if repeat == 0 else f"{policy}-real-{repeat + 1}"


def spread_evenly(passes: int, runs: int) -> list[int]:
    """Before which real runs (``runs``: after the last) ``passes`` profiler
    passes go: the first before any run, the last after all, the rest between,
    evenly."""
    if passes == 1:
        return [0]
    return [round(i * runs / (passes - 1)) for i in range(passes)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policies", nargs="+", default=["fcfs", "sjf", "priority", "vtc"])
    ap.add_argument("--traces", nargs="+", default=["azure_conv", "mooncake_conv"])
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--load", type=float, default=0.7)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--out", default=str(ROOT / "experiments/results/fidelity_cpu"))
    ap.add_argument("--runs", default=str(ROOT / "outputs/fidelity"))
    ap.add_argument("--extra", nargs="*", default=[], help="more Hydra overrides for both modes")
    ap.add_argument("--wandb", default="offline", choices=["offline", "online", "disabled"])
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="real runs per pair, in rounds (every policy once per round); the "
        "simulation is compared with their mean, and their spread is reported",
    )
    ap.add_argument(
        "--noise",
        action="store_true",
        help="run each trace's first policy at least twice and report the two real "
        "runs against each other",
    )
    ap.add_argument(
        "--edges",
        action="store_true",
        help="one more real run of each trace before its runs and one after them "
        "(the rounds continued), used only as neighbours of the first and last "
        "runs (nb_err_*)",
    )
    ap.add_argument(
        "--speed-probe",
        action="store_true",
        help="probe the machine's speed around each real run and also simulate "
        "each pair scaled by its ratio to the profile's probe",
    )
    ap.add_argument(
        "--idle-probe",
        action="store_true",
        help="sample the machine's speed in each real run's idle gaps "
        "(mode.idle_probe=true) and also simulate each pair with every step scaled "
        "by the ratio of the run's probe to the profile's (idle_err_*)",
    )
    ap.add_argument(
        "--profile-first",
        action="store_true",
        help="measure a fresh profile into the runs folder first and simulate "
        "with it (on a machine whose speed drifts, calibrate just before)",
    )
    ap.add_argument(
        "--profile-passes",
        type=int,
        default=0,
        metavar="K",
        help="measure the profile in K passes spread evenly over the real runs "
        "(the first before them, the last after) and simulate with all K merged; "
        "the rates are set with the first pass",
    )
    ap.add_argument(
        "--profile-extra",
        nargs="*",
        default=[],
        help="Hydra overrides for the profiler passes alone (e.g. mode.repeats=3)",
    )
    ap.add_argument(
        "--reuse",
        metavar="RUNS_DIR",
        help="take the real runs (and the profile, if it measured one and --extra "
        "sets no profiles_dir) from an earlier invocation's runs folder instead of "
        "running them again: re-simulate and re-analyse only",
    )
    ap.add_argument(
        "--in-process",
        action="store_true",
        help="run the real runs and profiler passes in this process rather than "
        "each in a fresh one (starts faster; later runs inherit earlier ones' state)",
    )
    args = ap.parse_args()
    interrupt_on_sigterm()  # stopped by timeout or kill: the finished runs are analysed
    if args.repeats < 1 or args.profile_passes < 0:
        raise SystemExit("--repeats must be >= 1 and --profile-passes >= 0")
    out, runs = Path(args.out), Path(args.runs) / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    reuse = Path(args.reuse) if args.reuse else None
    quiet = ["logging=disabled", "progress=false", "plots=false"]
    own_profiles = any(x.startswith("profiles_dir=") for x in args.extra)
    passes = args.profile_passes or (1 if args.profile_first else 0)
    if reuse is not None or own_profiles:
        passes = 0  # the reused runs' profile, or the one --extra names
    pass_files: list[Path] = []

    def measure(overrides: list[str], run_dir: Path | None = None) -> None:
        """A real run or a profiler pass, in a fresh process unless --in-process."""
        if args.in_process:
            run_from_config(compose_cfg(overrides), run_dir)
        else:
            run_isolated(overrides, run_dir)

    def profile_pass() -> None:
        """One profiler pass, merged with the earlier ones into runs/profiles."""
        k = len(pass_files)
        print(f"profiler pass {k + 1} of {passes} ...", flush=True)
        d = runs / "profile-passes" / str(k + 1)
        # The profiler replays its own trace: trace options (which the default
        # trace may not declare) are for the runs only.
        machine = [x for x in args.extra if not x.lstrip("+~").startswith(("trace.", "trace="))]
        overrides = ["mode=profile", f"profiles_dir={d}", *machine, *args.profile_extra]
        measure(overrides)
        (path,) = d.glob("*/*.csv")
        pass_files.append(path)
        merge_profiles(pass_files, runs / "profiles" / path.parent.name / path.name)

    if reuse is not None and (reuse / "profiles").is_dir() and not own_profiles:
        quiet.append(f"profiles_dir={(reuse / 'profiles').resolve()}")
    elif passes:
        profile_pass()
        quiet.append(f"profiles_dir={runs / 'profiles'}")
    # Where the profiler passes are, each alone (for the per-pass simulations):
    # measured now, or by the reused invocation (unless --extra names a profile).
    passes_from = runs if passes else None
    if reuse is not None and not own_profiles:
        passes_from = reuse
    probes: dict[str, list[float]] = {}
    if args.speed_probe:
        base = compose_cfg([*quiet, *args.extra])
        probe_setup = probe_engine(engine_args(base), model=engine_model(base))

    def real_run(overrides: list[str], name: str, repeat: int | None) -> Path | None:
        """The real run ``name`` (e.g. trace/fcfs-real), or the reused one (None
        where the reused folder has none)."""
        if reuse is not None:
            found = reuse / name
            if repeat == 1 and not (found / "metrics.json").exists():
                found = reuse / f"{name.rsplit('-', 1)[0]}-again"  # as --noise named it
            if not (found / "metrics.json").exists():
                print(f"--reuse: {reuse / name} holds no real run; left out")
                return None
            return found
        if args.speed_probe:
            probes.setdefault(name, []).append(speed_probe(*probe_setup))
        probe = ["mode.idle_probe=true"] if args.idle_probe else []
        measure([*overrides, "mode=real", *probe], runs / name)
        if args.speed_probe:
            probes[name].append(speed_probe(*probe_setup))
        return runs / name

    # The rates: each trace at --load of its capacity in simulation.
    plans: dict[str, tuple[float, float, list[str]]] = {}  # trace: capacity, rate, overrides
    for spec in args.traces:
        # "name" or "name:option=value,option=value" (trace options for that trace only)
        trace, _, opts = spec.partition(":")
        own = [f"trace.{kv}" for kv in opts.split(",") if kv]
        common = [
            f"trace={trace}",
            f"trace.num_requests={args.num_requests}",
            f"trace.max_model_len={args.max_model_len}",
            *own,
            *quiet,
            *args.extra,
        ]
        if reuse is not None:  # the rate its real runs were replayed at
            known = reuse / trace / "rate.json"
            if not known.exists():
                raise SystemExit(
                    f"--reuse: {known} is missing; write the rate the real runs were "
                    'replayed at: {"capacity_req_s": ..., "rate_req_s": ...}'
                )
            rates = json.loads(known.read_text())
            cap, rate = rates["capacity_req_s"], rates["rate_req_s"]
        else:
            cap = capacity(common)
            rate = round(args.load * cap, 3)
        (runs / trace).mkdir(parents=True, exist_ok=True)
        (runs / trace / "rate.json").write_text(
            json.dumps(dict(capacity_req_s=cap, rate_req_s=rate)) + "\n"
        )
        print(f"{trace}: capacity {cap:.3f} req/s in simulation; replaying at {rate} req/s")
        plans[trace] = (cap, rate, common)

    def pair_overrides(trace: str, policy: str) -> list[str]:
        """What a pair's runs, real and simulated, are composed from."""
        _, rate, common = plans[trace]
        return [*common, f"policy={policy}", f"trace.rate={rate}"]

    # The real runs, in rounds (each policy once per round, so a pair's repeats
    # are spread over the experiment; every other round reversed: see rounds),
    # with the profiler passes between them. With --edges the rounds go on one
    # run either side (the first round's last policy before, the last round's
    # first policy after): runs for neighbour_speeds alone (repeat None), so
    # that every pair's runs have neighbours of another policy on both sides.
    schedule: list[tuple[str, str, int | None, str]] = []
    first = args.policies[0]
    order = rounds(args.policies, args.repeats)
    for trace in plans:
        if args.edges:
            edge = order[0][-1]
            schedule.append((trace, edge, None, f"edge-before-{edge}-real"))
        for repeat, policies in enumerate(order):
            for policy in policies:
                schedule.append((trace, policy, repeat, run_name(policy, repeat)))
        if args.noise and args.repeats == 1:
            schedule.append((trace, first, 1, run_name(first, 1)))
        if args.edges:
            edge = order[-1][0]
            schedule.append((trace, edge, None, f"edge-after-{edge}-real"))
    # An interrupted real run (Ctrl-C: it writes its files, marked partial) ends
    # the experiment; what finished before it is still analysed and written.
    before = spread_evenly(passes, len(schedule))[1:] if passes else []
    reals: dict[tuple[str, str], list[Path]] = {}
    ran: list[tuple[str, str, Path]] = []  # every finished real run, in order
    interrupted = False
    try:
        for i, (trace, policy, repeat, folder) in enumerate(schedule):
            while before and before[0] <= i:
                before.pop(0)
                profile_pass()
            run = real_run(pair_overrides(trace, policy), f"{trace}/{folder}", repeat)
            if run is None:
                continue
            if read_metrics(run).get("partial"):
                print(f"{run} did not finish (partial): left out")
                if reuse is None:
                    interrupted = True
                    break
                continue
            if repeat is not None:
                reals.setdefault((trace, policy), []).append(run)
            ran.append((trace, policy, run))
        else:
            for _ in before:
                profile_pass()
    except KeyboardInterrupt:
        interrupted = True
    if interrupted:
        print("interrupted: no more real runs; analysing the finished ones")
    if not reals:
        raise SystemExit("no finished real run to compare with")

    pass_dirs = []
    if passes_from is not None:
        pass_dirs = sorted((passes_from / "profile-passes").glob("*"), key=lambda d: int(d.name))
        pass_dirs = [d.resolve() for d in pass_dirs]
    # Every real run's steps predicted by its pair's latency model, and the
    # machine's speed around each run (neighbour_speeds).
    models = {
        (trace, policy): latency_model(compose_cfg([*pair_overrides(trace, policy), "mode=sim"]))
        for trace in plans
        for policy in args.policies
    }
    # How well the latency model fits its own profile: over FIT_WARN (a warning), the machine's
    # speed moved while it was profiled, and every error below carries that.
    fits = [m.fit_rel_error for m in models.values() if hasattr(m, "fit_rel_error")]
    profile_fit = max(fits) if fits else None
    if profile_fit is not None:
        print(fit_line(profile_fit))
    mismatches = machine_mismatches([(run, models[t, p]) for t, p, run in ran])
    for line in mismatches:
        print(line, flush=True)
    predicted_of = {run: busy_steps(run, models[t, p]) for t, p, run in ran}
    own_of = {run: own_speed(step_errors(predicted_of[run])) for _, _, run in ran}
    around = neighbour_speeds([(t, p) for t, p, _ in ran], [own_of[run] for _, _, run in ran])
    around_of = dict(zip([run for _, _, run in ran], around, strict=True))
    profiled_of = {  # the profile's reference probe, for the runs that ran one
        run: profile_reference(models[t, p])
        for t, p, run in ran
        if (run / "reference_probe.csv").exists()
    }
    speeds = run_speeds(ran, predicted_of, own_of, around_of, profiled_of)
    rows, pairs = [], []
    by_trace: dict[str, dict[str, PairRuns]] = {}
    by_size: dict[str, list[pd.DataFrame]] = {}  # trace: its real runs' busy_steps
    sources: set[str | None] = set()  # the latency models the pairs were simulated with
    for trace, (cap, rate, _) in plans.items():
        here = runs / trace
        for policy in args.policies:
            both = pair_overrides(trace, policy)
            model = models[trace, policy]  # the simulation's fit
            repeats = reals.get((trace, policy), [])
            if not repeats:
                print(f"  {trace}/{policy}: no finished real run; left out")
                continue
            measured = repeats[: args.repeats]  # a --noise run is not a repeat
            real = measured[0]
            if len(measured) > 1:
                real = average_runs(measured, here / f"{policy}-real-mean")
            sim = simulate(both, here / f"{policy}-sim")
            sources.add(simulated_with(sim))
            warning = reuse and reuse_warning(reuse / trace / f"{policy}-sim", sim)
            if warning:
                print(warning, flush=True)
            pair_runs = by_trace.setdefault(trace, {})[policy] = PairRuns(sim, measured)
            predicted = [predicted_of[r] for r in measured]
            by_size.setdefault(trace, []).extend(predicted)
            steps = step_errors(pd.concat(predicted))  # the runs' steps together
            row = dict(
                trace=trace,
                policy=policy,
                rate_req_s=rate,
                capacity_req_s=cap,
                **compare(sim, real),
                **steps,
                real_queued_steps=queued_steps(real),
            )
            if len(measured) > 1:
                # Every run alone at its own speed: how much of the runs' spread
                # the machine's speed explains, and the policy effects round by round.
                for k, r in enumerate(measured):
                    own_dir = here / f"{policy}-sim-own-speed-{k + 1}"
                    pair_runs.own.append(simulate(both, own_dir, own_of[r]))
                row.update(repeat_spread(sim, measured, pair_runs.own))
            if len(pass_dirs) > 1:
                # One simulation per profiler pass, their metrics averaged: the
                # expectation over the speeds the passes sampled. A burst amplifies
                # slower steps more than faster ones shorten it, so this mean is
                # not the simulation at the passes' mean speed (the merged fit).
                base = [o for o in both if not o.startswith("profiles_dir=")]
                sims = [
                    simulate([*base, f"profiles_dir={d}"], here / f"{policy}-sim-pass{k + 1}")
                    for k, d in enumerate(pass_dirs)
                ]
                ensemble = average_runs(sims, here / f"{policy}-sim-passes")
                row.update(prefixed_errors(ensemble, real, "pass"))
            # At the real run's own speed: every step scaled by how much slower the
            # machine ran its steps than the profile predicts. Not a prediction (it
            # is calibrated on the run itself): the simulator's error apart from the
            # machine's drift since it was profiled.
            speed = own_speed(steps)
            row.update(own_speed_factor=speed)
            row.update(scaled_errors(both, here / f"{policy}-sim-own-speed", real, speed, "own"))
            # At the run's speed window by window (run_speed_trace): the machine's
            # speed as it wandered during each real run. Calibrated on the run
            # too; what it gains over the constant own speed is the machine's
            # variation within the run, which a queue amplifies (a slow stretch
            # lengthens the queue more than a fast one shortens it).
            by_window = []
            for k, r in enumerate(measured):
                name = f"{policy}-sim-run-speed-{k + 1}"
                trace_csv = run_speed_trace(predicted_of[r]).to_csv(
                    here / f"{name}.csv",
                    note=f"{r}: busy time / prediction per {TRACE_WINDOW_S:g} s (fidelity.py)",
                )
                by_window.append(simulate([*both, f"mode.speed_trace={trace_csv}"], here / name))
            if len(by_window) > 1:
                by_window = [average_runs(by_window, here / f"{policy}-sim-run-speed")]
            row.update(prefixed_errors(by_window[0], real, "win"))
            pair_runs.by_window = by_window[0]
            # At the machine's speed around the runs: the real engine's speed in
            # the nearest runs of the same trace and other policies, before and
            # after each of the pair's runs (neighbour_speeds). Calibrated on
            # real step records, but not on the pair's own.
            near = [around_of[r] for r in measured if np.isfinite(around_of[r])]
            if near:
                factor = float(np.mean(near))
                row.update(neighbour_speed_factor=factor)
                row.update(
                    scaled_errors(both, here / f"{policy}-sim-neighbours", real, factor, "nb")
                )
            # At the machine's speed during the run as the idle probe sampled it
            # between requests (never beside a step): a measurement of the machine,
            # not of the run, so this is the simulator given the machine's speed.
            idle = read_metrics(real).get("idle_probe_s")
            if idle is not None and np.isfinite(idle):
                factor = idle / profile_probe(model, "idle_probe_s", "--idle-probe")
                row.update(idle_probe_s=idle, idle_speed_factor=factor)
                row.update(
                    scaled_errors(both, here / f"{policy}-sim-idle-probe", real, factor, "idle")
                )
            # At the machine's speed as the reference probe on another core measured
            # it beside the busy engine (hardware.reference_cpus): one factor per pair,
            # and window by window through each run. A measurement of the machine
            # at the time of the run, not of the run's steps.
            ref = read_metrics(real).get("reference_probe_s")
            if ref is not None and np.isfinite(ref):
                profiled = profile_reference(model)
                factor = ref / profiled
                row.update(reference_probe_s=ref, reference_speed_factor=factor)
                row.update(
                    scaled_errors(both, here / f"{policy}-sim-reference", real, factor, "ref")
                )
                traced = []
                for k, r in enumerate(measured):
                    speed_trace = reference_speed_trace(r, profiled)
                    if speed_trace is None:
                        continue
                    name = f"{policy}-sim-reference-windows-{k + 1}"
                    trace_csv = speed_trace.to_csv(
                        here / f"{name}.csv",
                        note=f"{r}: reference probe / profile's per {TRACE_WINDOW_S:g} s",
                    )
                    traced.append(simulate([*both, f"mode.speed_trace={trace_csv}"], here / name))
                if len(traced) > 1:
                    traced = [average_runs(traced, here / f"{policy}-sim-reference-windows")]
                if traced:
                    row.update(prefixed_errors(traced[0], real, "refwin"))
            around = [p for r in measured for p in probes.get(f"{trace}/{r.name}", [])]
            if around:
                factor = float(np.mean(around)) / profile_probe(model)
                row.update(probe_before_s=around[0], probe_after_s=around[-1], speed_factor=factor)
                row.update(
                    scaled_errors(both, here / f"{policy}-sim-corrected", real, factor, "cor")
                )
            if len(repeats) > 1 and policy == args.policies[0]:  # the noise floor
                rows.append(
                    dict(
                        trace=trace,
                        policy=f"{policy}{NOISE}",
                        rate_req_s=rate,
                        capacity_req_s=cap,
                        **compare(repeats[1], repeats[0]),  # the same real run, twice
                    )
                )
            rows.append(row)
            pairs.append((f"{trace}/{policy}", sim, real))
            print(
                f"  {policy}: throughput {row['err_throughput_req_s']:+.1%}, "
                f"{latency_summary(row)}, E2E corr {row['e2e_corr']:.3f}; "
                f"real steps predicted {row['step_err_total']:+.1%} (busy time), "
                f"{row['step_err_per_request']:+.1%} (per request), "
                f"{row['step_err_median']:+.1%} (median step)"
            )
            if len(measured) > 1:
                print(
                    f"    against the mean of {len(measured)} real runs, which spread "
                    f"{row['real_spread_tpot_s_mean']:.1%} in TPOT mean; against each alone: "
                    f"TPOT mean {row['err_min_tpot_s_mean']:+.1%} to "
                    f"{row['err_max_tpot_s_mean']:+.1%}; each at its own speed: "
                    f"TPOT mean {row['own_each_err_min_tpot_s_mean']:+.1%} to "
                    f"{row['own_each_err_max_tpot_s_mean']:+.1%}, E2E mean "
                    f"{row['own_each_err_min_e2e_s_mean']:+.1%} to "
                    f"{row['own_each_err_max_e2e_s_mean']:+.1%}"
                )
            if len(pass_dirs) > 1:
                print(
                    f"    mean of {len(pass_dirs)} simulations, one per profiler pass: "
                    + latency_summary(row, "pass_")
                )
            print(f"    at the run's own speed (x{speed:.3f}): " + latency_summary(row, "own_"))
            print(
                f"    at the run's speed by {TRACE_WINDOW_S:g} s window: "
                + latency_summary(row, "win_")
            )
            if "neighbour_speed_factor" in row:
                print(
                    f"    at the neighbouring runs' speed (x{row['neighbour_speed_factor']:.3f}): "
                    + latency_summary(row, "nb_")
                )
            if "idle_speed_factor" in row:
                print(
                    f"    at the idle probe's speed (x{row['idle_speed_factor']:.3f}): "
                    + latency_summary(row, "idle_")
                )
            if "reference_speed_factor" in row:
                print(
                    f"    at the reference probe's speed (x{row['reference_speed_factor']:.3f}): "
                    + latency_summary(row, "ref_")
                )
            if "refwin_err_tpot_s_mean" in row:
                print(
                    f"    at the reference probe's speed by {TRACE_WINDOW_S:g} s window: "
                    + latency_summary(row, "refwin_")
                )
            if around:
                print(
                    f"    machine {row['speed_factor']:.3f}x its profiled step time; corrected: "
                    + latency_summary(row, "cor_")
                )
    table = pd.DataFrame(rows)
    table.to_csv(out / "fidelity.csv", index=False, float_format="%.6g")
    effects, orders = policy_effects(by_trace, args.policies[0])
    effects.to_csv(out / "policy_effects.csv", index=False, float_format="%.6g")
    orders.to_csv(out / "policy_orders.csv", index=False)
    effects_md = effects_markdown(effects, orders)
    sizes = steps_by_size(by_size)
    sizes.to_csv(out / "steps_by_size.csv", index=False, float_format="%.6g")
    sizes_md = sizes_markdown(sizes)
    speeds.to_csv(out / "run_speeds.csv", index=False, float_format="%.6g")
    steadiness = speed_summary(speeds)  # how steady the machine was, per trace
    (out / "fidelity.md").write_text(
        "".join(f"{line}\n\n" for line in mismatches)
        + markdown(table)
        + (f"\n## Policy effects against {args.policies[0]}\n\n" + effects_md if effects_md else "")
        + ("\n## The latency model on the real steps, by batch\n\n" + sizes_md if sizes_md else "")
        + "\n## The machine's speed, run by run\n\n"
        + speeds_markdown(steadiness)
    )
    meta = dict(
        date=time.strftime("%Y-%m-%d"),
        load=args.load,
        num_requests=args.num_requests,
        max_model_len=args.max_model_len,
        extra=args.extra,
        runs=str(runs.relative_to(ROOT)) if runs.is_relative_to(ROOT) else str(runs),
        reused_real_runs=str(reuse) if reuse else None,
        repeats=args.repeats,
        profile_passes=len(pass_dirs),
        profile_fit_rel_error=profile_fit,
        machine_mismatches=mismatches,
        profile_reference=sorted(
            {profile_reference_key(models[t, p]) for t, p, run in ran if run in profiled_of}
        ),
        simulated_with=sorted(map(str, sources)),
        interrupted=interrupted,
    )
    summary = dict(
        meta=meta,
        rows=rows,
        policy_effects=effects.to_dict("records"),
        policy_orders=orders.to_dict("records"),
        steps_by_size=sizes.to_dict("records"),
        run_speeds=speeds.to_dict("records"),
        speed_summary=steadiness.to_dict("records"),
    )
    (out / "fidelity.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(pairs, out / "fidelity.png")
    print(markdown(table))
    if effects_md:
        print(effects_md)
    log_experiment(
        args.wandb,
        runs,
        "fidelity",
        meta,
        tables=dict(
            fidelity=table,
            policy_effects=effects,
            policy_orders=orders,
            steps_by_size=sizes,
            run_speeds=speeds,
        ),
        images=dict(fidelity_plots=out / "fidelity.png"),
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
