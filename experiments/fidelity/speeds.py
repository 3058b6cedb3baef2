"""How fast the machine ran each real run against the latency model: over the
whole run, window by window, at its neighbours, and as the reference probe on
another core saw it; and how steady it was over the experiment."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from testbed.profiling.reference_probe import beside_busy, reference_key
from testbed.sim.run_speed import SPEED_WINDOW_S, predict_logged_steps, speed_by_window
from testbed.sim.speed import SpeedTrace

from .compare import step_errors
from .execute import read_metrics

# steps.csv columns that busy_steps reads (the latency model's features among them)
STEP_COLUMNS = ("start_s", "latency_s", "num_reqs", "num_prefill_tokens", "num_decode_tokens",
                "attn_pairs", "kv_tokens", "max_kv")  # fmt: skip
NEIGHBOURS = 2  # runs on each side that :func:`neighbour_speeds` averages
WINDOW_S = SPEED_WINDOW_S  # the stretches of a run that :func:`window_speeds` measures
TRACE_WINDOW_S = 10.0  # the windows of a run's :func:`run_speed_trace`


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


def own_speed(steps: dict) -> float:
    """The factor that scales the latency model to a real run's own speed: its
    busy time over the model's prediction of the same steps (from
    :func:`~experiments.fidelity.compare.step_errors`)."""
    return 1 / (1 + steps["step_err_total"])


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


def window_trace(speeds: pd.Series, first: float, width_s: float) -> SpeedTrace:
    """Speeds by window number (some windows missing) as a speed trace from 0: a
    missing window takes the previous one's factor, the first ``first``."""
    filled = speeds.reindex(range(int(speeds.index.max()) + 1)).ffill()
    return SpeedTrace.from_windows(width_s, filled.fillna(first).tolist())


def run_speed_trace(steps: pd.DataFrame, width_s: float = TRACE_WINDOW_S) -> SpeedTrace:
    """A real run's speed window by window as the simulator's speed trace
    (``mode.speed_trace``): one row per ``width_s`` seconds from 0, the
    :func:`windows` speed, where no step started the previous window's (the
    first: the run's :func:`own_speed`)."""
    return window_trace(windows(steps, width_s), own_speed(step_errors(steps)), width_s)


def profile_reference_key(model) -> str:
    """The profile header's reference probe that runs are scaled against: the
    median during its replay, whose steps set the latency model's level, where
    the header has it (:func:`~testbed.profiling.reference_probe.reference_key`)."""
    return reference_key(getattr(model, "header", {}))


def profile_reference(model) -> float:
    """The profile's :func:`profile_reference_key` probe, in seconds; an error
    naming the profile where it records none."""
    key = profile_reference_key(model)
    value = getattr(model, "header", {}).get(key)
    if value is None:
        raise SystemExit(
            f"hardware.reference_cpus: the simulator's latency model ({model.source}) records "
            f"no {key}; profile with the reference probe (python run.py mode=profile "
            "hardware.reference_cpus=[...]) or use --profile-passes"
        )
    return float(value.split()[0])


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


class RunSpeeds:
    """Every finished real run's busy steps as its pair's latency model predicts
    them, its own speed, its neighbours' and the profile's reference probe (for
    the runs that ran one), in the order the runs ran (``ran``: trace, policy,
    folder; ``models``: each pair's latency model)."""

    def __init__(self, ran: list[tuple[str, str, Path]], models: dict):
        self.predicted = {run: busy_steps(run, models[t, p]) for t, p, run in ran}
        self.own = {run: own_speed(step_errors(self.predicted[run])) for _, _, run in ran}
        around = neighbour_speeds([(t, p) for t, p, _ in ran], [self.own[r] for _, _, r in ran])
        self.around = dict(zip([run for _, _, run in ran], around, strict=True))
        self.profiled = {
            run: profile_reference(models[t, p])
            for t, p, run in ran
            if (run / "reference_probe.csv").exists()
        }
        self.table = run_speeds(ran, self.predicted, self.own, self.around, self.profiled)
