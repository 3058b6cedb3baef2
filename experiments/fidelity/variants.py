"""Each pair simulated at the speeds that the machine ran at, beside the
prediction from the profile alone: each way is one function that simulates the
pair and names its errors by a column prefix (:data:`VARIANTS`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from testbed.build import latency_model
from testbed.config_schema import compose_config

from .compare import (
    NOISE,
    PairRuns,
    pair_errors,
    prefixed_errors,
    queued_steps,
    repeat_spread,
    reuse_warning,
    simulated_with,
    step_errors,
)
from .execute import average_runs, read_metrics, simulate, simulate_traced
from .plan import TracePlan
from .report import pair_lines
from .speeds import (
    TRACE_WINDOW_S,
    RunSpeeds,
    own_speed,
    profile_reference,
    reference_speed_trace,
    run_speed_trace,
)

VARIANTS = {  # column prefix of a simulation's errors: what gave it the machine's speed
    "": "the profile alone (the prediction)",
    "pass_": "each profiler pass alone, the simulations averaged",
    "own_": "the runs' own speed (calibrated on the runs)",
    "win_": "the runs' speed by window (calibrated on the runs)",
    "nb_": "the neighbouring real runs' speed",
    "ref_": "the reference probe on another core",
    "refwin_": "the reference probe by window",
}


@dataclass
class Pair:
    """One trace and policy under analysis: what its runs are composed from, the
    folder of its simulations, its latency model, its real runs and the run its
    simulations are compared with (the mean of the runs with repeats)."""

    plan: TracePlan
    policy: str
    here: Path  # this invocation's folder of the trace's runs
    model: object
    measured: list[Path]
    real: Path

    @property
    def overrides(self) -> list[str]:
        return self.plan.pair(self.policy)

    def folder(self, name: str) -> Path:
        """``<runs>/<trace>/<policy>-<name>``, where a simulation of the pair goes."""
        return self.here / f"{self.policy}-{name}"


def pair_models(plans: dict[str, TracePlan], policies: list[str]) -> dict:
    """Every pair's latency model, as its simulation builds it."""
    return {
        (trace, policy): latency_model(compose_config([*plan.pair(policy), "mode=sim"]))
        for trace, plan in plans.items()
        for policy in policies
    }


def at_each_own_speed(pair: Pair, sim: Path, speeds: RunSpeeds) -> tuple[dict, list[Path]]:
    """With repeats, every run alone at its own speed: how much of the runs'
    spread the machine's speed explains, and the policy effects round by round."""
    own = [
        simulate(pair.overrides, pair.folder(f"sim-own-speed-{k + 1}"), speeds.own[r])
        for k, r in enumerate(pair.measured)
    ]
    return repeat_spread(sim, pair.measured, own), own


def per_pass(pair: Pair, pass_dirs: list[Path]) -> dict:
    """One simulation per profiler pass, their metrics averaged: the expectation
    over the speeds the passes sampled. A burst amplifies slower steps more than
    faster ones shorten it, so this mean is not the simulation at the passes'
    mean speed (the merged fit)."""
    base = [o for o in pair.overrides if not o.startswith("profiles_dir=")]
    sims = [
        simulate([*base, f"profiles_dir={d}"], pair.folder(f"sim-pass{k + 1}"))
        for k, d in enumerate(pass_dirs)
    ]
    return prefixed_errors(average_runs(sims, pair.folder("sim-passes")), pair.real, "pass")


def at_own_speed(pair: Pair, speed: float) -> dict:
    """Every step scaled by how much slower the machine ran the real steps than
    the profile predicts: calibrated on the run itself, so not a prediction, but
    the simulator's error apart from the machine's drift since it was profiled."""
    sim = simulate(pair.overrides, pair.folder("sim-own-speed"), speed)
    return dict(own_speed_factor=speed, **prefixed_errors(sim, pair.real, "own"))


def by_window(pair: Pair, speeds: RunSpeeds) -> tuple[dict, Path]:
    """At each run's speed window by window (:func:`run_speed_trace`; the
    simulations of repeats averaged). Calibrated on the run too; what it gains
    over the constant own speed is the machine's variation within the run, which
    a queue amplifies (a slow stretch lengthens the queue more than a fast one
    shortens it)."""
    sims = []
    for k, r in enumerate(pair.measured):
        note = f"{r}: busy time / prediction per {TRACE_WINDOW_S:g} s (experiments.fidelity)"
        speed_trace = run_speed_trace(speeds.predicted[r])
        folder = pair.folder(f"sim-run-speed-{k + 1}")
        sims.append(simulate_traced(pair.overrides, folder, speed_trace, note))
    if len(sims) > 1:
        sims = [average_runs(sims, pair.folder("sim-run-speed"))]
    return prefixed_errors(sims[0], pair.real, "win"), sims[0]


def at_neighbours(pair: Pair, speeds: RunSpeeds) -> dict:
    """At the real engine's speed in the nearest runs of the same trace and other
    policies, before and after each of the pair's runs: calibrated on real step
    records, but not on the pair's own. Empty where the trace has no such run."""
    near = [speeds.around[r] for r in pair.measured if np.isfinite(speeds.around[r])]
    if not near:
        return {}
    factor = float(np.mean(near))
    sim = simulate(pair.overrides, pair.folder("sim-neighbours"), factor)
    return dict(neighbour_speed_factor=factor, **prefixed_errors(sim, pair.real, "nb"))


def at_reference(pair: Pair) -> dict:
    """At the machine's speed as the reference probe on another core measured it
    beside the busy engine (``hardware.reference_cpus``): one factor per pair
    (``ref_``), and window by window through each run (``refwin_``). A
    measurement of the machine at the time of the run, not of the run's steps.
    Empty where the runs ran without it."""
    ref = read_metrics(pair.real).get("reference_probe_s")
    if ref is None or not np.isfinite(ref):
        return {}
    profiled = profile_reference(pair.model)
    factor = ref / profiled
    sim = simulate(pair.overrides, pair.folder("sim-reference"), factor)
    row = dict(reference_probe_s=ref, reference_speed_factor=factor)
    row.update(prefixed_errors(sim, pair.real, "ref"))
    traced = []
    for k, r in enumerate(pair.measured):
        speed_trace = reference_speed_trace(r, profiled)
        if speed_trace is not None:
            note = f"{r}: reference probe / profile's per {TRACE_WINDOW_S:g} s"
            folder = pair.folder(f"sim-reference-windows-{k + 1}")
            traced.append(simulate_traced(pair.overrides, folder, speed_trace, note))
    if len(traced) > 1:
        traced = [average_runs(traced, pair.folder("sim-reference-windows"))]
    if traced:
        row.update(prefixed_errors(traced[0], pair.real, "refwin"))
    return row


def analyse_pair(pair: Pair, speeds: RunSpeeds, pass_dirs: list[Path]) -> tuple[dict, PairRuns]:
    """A pair's row of ``fidelity.csv``: the profile's prediction against the real
    runs, the latency model on their steps, and every variant that applies."""
    sim = simulate(pair.overrides, pair.folder("sim"))
    runs = PairRuns(sim, pair.measured)
    steps = step_errors(pd.concat([speeds.predicted[r] for r in pair.measured]))
    row = dict(
        trace=pair.plan.name,
        policy=pair.policy,
        rate_req_s=pair.plan.rate,
        capacity_req_s=pair.plan.capacity,
        **pair_errors(sim, pair.real),
        **steps,
        real_queued_steps=queued_steps(pair.real),
    )
    if len(pair.measured) > 1:
        spread, runs.own = at_each_own_speed(pair, sim, speeds)
        row.update(spread)
    if len(pass_dirs) > 1:
        row.update(per_pass(pair, pass_dirs))
    row.update(at_own_speed(pair, own_speed(steps)))
    window, runs.by_window = by_window(pair, speeds)
    row.update(window)
    row.update(at_neighbours(pair, speeds))
    row.update(at_reference(pair))
    return row, runs


@dataclass
class Analysis:
    """Every pair's row (and the noise floor's), their runs per trace and policy,
    each trace's real steps as predicted, and the latency models simulated with."""

    rows: list[dict] = field(default_factory=list)
    by_trace: dict[str, dict[str, PairRuns]] = field(default_factory=dict)
    by_size: dict[str, list[pd.DataFrame]] = field(default_factory=dict)
    sources: set[str | None] = field(default_factory=set)
    plotted: list[tuple[str, Path, Path]] = field(default_factory=list)  # label, sim, real


def noise_row(plan: TracePlan, policy: str, repeats: list[Path]) -> dict:
    """The first real run's repeat against it: the machine's noise floor."""
    return dict(
        trace=plan.name,
        policy=f"{policy}{NOISE}",
        rate_req_s=plan.rate,
        capacity_req_s=plan.capacity,
        **pair_errors(repeats[1], repeats[0]),
    )


def analyse(
    plans: dict[str, TracePlan],
    policies: list[str],
    reals: dict[tuple[str, str], list[Path]],
    models: dict,
    speeds: RunSpeeds,
    repeats: int,
    pass_dirs: list[Path],
    runs_dir: Path,
    reuse: Path | None,
) -> Analysis:
    """Every pair with a finished real run: its row, with the noise floor's
    before the first policy's where that policy ran twice."""
    out = Analysis()
    for trace, plan in plans.items():
        for policy in policies:
            finished = reals.get((trace, policy), [])
            if not finished:
                print(f"  {trace}/{policy}: no finished real run; left out")
                continue
            measured = finished[:repeats]  # a --noise run is not a repeat
            here = runs_dir / trace
            real = measured[0]
            if len(measured) > 1:
                real = average_runs(measured, here / f"{policy}-real-mean")
            pair = Pair(plan, policy, here, models[trace, policy], measured, real)
            row, pair_runs = analyse_pair(pair, speeds, pass_dirs)
            out.sources.add(simulated_with(pair_runs.sim))
            warning = reuse and reuse_warning(reuse / trace / f"{policy}-sim", pair_runs.sim)
            if warning:
                print(warning, flush=True)
            out.by_trace.setdefault(trace, {})[policy] = pair_runs
            out.by_size.setdefault(trace, []).extend(speeds.predicted[r] for r in measured)
            if len(finished) > 1 and policy == policies[0]:
                out.rows.append(noise_row(plan, policy, finished))
            out.rows.append(row)
            out.plotted.append((f"{trace}/{policy}", pair_runs.sim, real))
            print("\n".join(pair_lines(row, len(measured), len(pass_dirs))), flush=True)
    return out
