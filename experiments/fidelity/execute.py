"""Running an experiment's runs: real runs and profiler passes (each in a fresh
process, or in this one), simulations, and real runs of an earlier invocation
reused in their place."""

from __future__ import annotations

import json
import multiprocessing
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from testbed.config_schema import compose_config
from testbed.job import run_from_config
from testbed.profile_table import merge_profiles
from testbed.signals import interrupt_on_sigterm
from testbed.sim.speed import SpeedTrace

ROOT = Path(__file__).resolve().parents[2]


def _run_child(overrides: list[str], run_dir: Path | None) -> None:
    """:func:`run_isolated`'s process: Ctrl-C is its parent's to forward (as
    SIGTERM, which stops the run the way Ctrl-C would)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    interrupt_on_sigterm()
    run_from_config(compose_config(overrides), run_dir)


def run_isolated(overrides: list[str], run_dir: Path | None = None) -> None:
    """``run_from_config(compose_config(overrides), run_dir)`` in a fresh Python
    process, so that no run inherits an earlier one's state (heap, caches, the
    simulations between them), as separate invocations would not. Interrupted
    (Ctrl-C, SIGTERM), the run is stopped and writes what it measured
    (partial), as in-process."""
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


def measure(overrides: list[str], run_dir: Path | None = None, in_process: bool = False) -> None:
    """A real run or a profiler pass: in a fresh process unless ``in_process``."""
    if in_process:
        run_from_config(compose_config(overrides), run_dir)
    else:
        run_isolated(overrides, run_dir)


def simulate(overrides: list[str], run_dir: Path, scale: float = 1.0) -> Path:
    """The simulation of ``overrides``, every step scaled by ``scale``."""
    scaled = [f"mode.latency_scale={scale:.6f}"] if scale != 1.0 else []
    run_from_config(compose_config([*overrides, "mode=sim", *scaled]), run_dir)
    return run_dir


def simulate_traced(overrides: list[str], run_dir: Path, speeds: SpeedTrace, note: str) -> Path:
    """The simulation of ``overrides`` at the machine speeds ``speeds``
    (``mode.speed_trace``), written beside it as ``<run_dir>.csv``."""
    csv = speeds.to_csv(run_dir.with_suffix(".csv"), note=note)
    return simulate([*overrides, f"mode.speed_trace={csv}"], run_dir)


def read_metrics(run_dir: Path) -> dict:
    """A run's ``metrics.json``."""
    return json.loads((run_dir / "metrics.json").read_text())


def average_runs(reals: list[Path], out: Path) -> Path:
    """Several runs of one pair (real runs, or simulations) as one run folder:
    every numeric metric the mean of the runs' (so a p50 is the mean of their
    p50s), every request's numeric columns the mean of its runs, and all their
    steps, so that it reads like any run. On a machine whose speed wanders, the
    mean of repeats is what a prediction can match."""
    metrics = [read_metrics(r) for r in reals]
    merged = dict(metrics[0])
    for key, value in metrics[0].items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            merged[key] = float(np.mean([m[key] for m in metrics]))
    merged["averaged_runs"] = [r.name for r in reals]
    requests = [pd.read_csv(r / "requests.csv") for r in reals]
    numeric = list(requests[0].select_dtypes("number").columns)
    mean = pd.concat(requests).groupby("request_id", sort=False)[numeric].mean()
    first = requests[0].set_index("request_id")
    first[numeric] = mean.loc[first.index, numeric]
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(merged, indent=2) + "\n")
    first.reset_index().to_csv(out / "requests.csv", index=False)
    steps = pd.concat([pd.read_csv(r / "steps.csv").assign(run=i) for i, r in enumerate(reals)])
    steps.to_csv(out / "steps.csv", index=False)
    return out


@dataclass
class ProfilerPasses:
    """``count`` profiler passes into ``runs/profile-passes/<k>``, merged after
    each into ``runs/profiles``, where the simulations read them."""

    runs: Path
    count: int
    overrides: list[str]  # the machine's (--extra less trace options) and the profiler's own
    in_process: bool = False
    files: list[Path] = field(default_factory=list)

    def measure_next(self) -> None:
        k = len(self.files) + 1
        print(f"profiler pass {k} of {self.count} ...", flush=True)
        d = self.runs / "profile-passes" / str(k)
        measure(["mode=profile", f"profiles_dir={d}", *self.overrides], None, self.in_process)
        (path,) = d.glob("*/*.csv")
        self.files.append(path)
        merge_profiles(self.files, self.runs / "profiles" / path.parent.name / path.name)


def reused_run(reuse: Path, name: str) -> Path | None:
    """The real run ``name`` (e.g. trace/fcfs-real) of an earlier invocation; None
    (said so) where it holds none."""
    found = reuse / name
    if not (found / "metrics.json").exists():
        print(f"--reuse: {found} holds no real run; left out")
        return None
    return found


@dataclass
class Finished:
    """The real runs that finished: per pair (in rounds), every one in the order
    it ran, and whether the experiment was stopped before the last."""

    reals: dict[tuple[str, str], list[Path]] = field(default_factory=dict)
    ran: list[tuple[str, str, Path]] = field(default_factory=list)
    interrupted: bool = False


def run_schedule(
    runs: list,
    real: Callable[[object], Path | None],
    before: list[int],
    profile_pass: Callable[[], None],
    reused: bool,
) -> Finished:
    """Every real run of ``runs`` (:class:`~experiments.fidelity.plan.RealRun`)
    through ``real`` (its folder, or None where there is none), with a profiler
    pass before each run whose index ``before`` lists (and those past the last
    run after it). A run that did not finish (interrupted: partial) ends the
    experiment, unless reused; what finished before it is still analysed."""
    done = Finished()
    before = list(before)
    try:
        for i, planned in enumerate(runs):
            while before and before[0] <= i:
                before.pop(0)
                profile_pass()
            run = real(planned)
            if run is None:
                continue
            if read_metrics(run).get("partial"):
                print(f"{run} did not finish (partial): left out")
                if not reused:
                    done.interrupted = True
                    break
                continue
            done.reals.setdefault((planned.trace, planned.policy), []).append(run)
            done.ran.append((planned.trace, planned.policy, run))
        else:
            for _ in before:
                profile_pass()
    except KeyboardInterrupt:
        done.interrupted = True
    if done.interrupted:
        print("interrupted: no more real runs; analysing the finished ones")
    if not done.reals:
        raise SystemExit("no finished real run to compare with")
    return done
