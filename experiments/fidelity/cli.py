"""The command line of ``python -m experiments.fidelity``: parse, plan, run, analyse, report."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd

from experiments.manifest import write_manifest
from testbed.profiling.fit_report import fit_line
from testbed.report.wandb_log import log_experiment
from testbed.signals import interrupt_on_sigterm

from . import __doc__ as DOC
from .compare import machine_mismatches, policy_effects, steps_by_size
from .execute import ROOT, ProfilerPasses, measure, reused_run, run_schedule
from .plan import QUIET, plan_traces, schedule, spread_evenly
from .report import effects_markdown, errors_markdown, fidelity_markdown, plot, write_tables
from .speeds import RunSpeeds, profile_reference_key, speed_summary
from .variants import analyse, pair_models


def parser() -> argparse.ArgumentParser:
    """The experiment's options: what runs (here) and how (:func:`add_method_options`)."""
    ap = argparse.ArgumentParser(
        prog="python -m experiments.fidelity", description=DOC.split("\n")[0]
    )
    ap.add_argument("--policies", nargs="+", default=["fcfs", "sjf", "priority", "vtc"])
    ap.add_argument(
        "--traces",
        nargs="+",
        default=["azure_conv", "mooncake_conv"],
        help="name or name:option=value,... (trace options for that trace alone)",
    )
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--load", type=float, default=0.7, help="of the capacity in simulation")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--extra", nargs="*", default=[], help="more Hydra overrides for both modes")
    ap.add_argument(
        "--runs", default=str(ROOT / "outputs/fidelity"), help="runs go to a new <stamp>/ here"
    )
    ap.add_argument("--out", help="tables and plots (default: the runs' <stamp>/ folder)")
    ap.add_argument("--wandb", default="offline", choices=["offline", "online", "disabled"])
    add_method_options(ap)
    return ap


def add_method_options(ap: argparse.ArgumentParser) -> None:
    """Repeats, the noise floor, profiler passes, reuse and the runs' processes."""
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="real runs per pair, in rounds (every other one reversed); the "
        "simulation is compared with their mean, and their spread is reported",
    )
    ap.add_argument(
        "--noise",
        action="store_true",
        help="run each trace's first policy at least twice: the real runs against each other",
    )
    ap.add_argument(
        "--profile-passes",
        type=int,
        default=0,
        metavar="K",
        help="measure the profile in K passes spread evenly over the real runs (the first, "
        "which sets the rates, before them; the last after) and simulate with them merged",
    )
    ap.add_argument(
        "--profile-extra", nargs="*", default=[], help="Hydra overrides for the profiler alone"
    )
    ap.add_argument(
        "--reuse",
        metavar="RUNS_DIR",
        type=Path,
        help="re-simulate and re-analyse an earlier invocation's real runs (and its profile, "
        "unless --extra sets profiles_dir) instead of running them again",
    )
    ap.add_argument(
        "--in-process",
        action="store_true",
        help="run the real runs and profiler passes in this process, not each in a fresh one",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = parser()
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.profile_passes < 0:
        ap.error("--repeats must be >= 1 and --profile-passes >= 0")
    return args


def profiles(args, runs: Path) -> tuple[ProfilerPasses, list[str], Path | None]:
    """Where the simulations' profile comes from: the passes this invocation
    measures (none with --reuse or a profiles_dir in --extra), the override that
    points the runs at it, and the folder whose ``profile-passes/`` hold the
    passes one by one."""
    own = any(x.startswith("profiles_dir=") for x in args.extra)
    count = 0 if args.reuse is not None or own else args.profile_passes
    # The profiler replays its own trace: trace options are for the runs only.
    machine = [x for x in args.extra if not x.lstrip("+~").startswith(("trace.", "trace="))]
    passes = ProfilerPasses(runs, count, [*machine, *args.profile_extra], args.in_process)
    if args.reuse is not None and not own:
        reused = args.reuse / "profiles"
        return passes, [f"profiles_dir={reused.resolve()}"] if reused.is_dir() else [], args.reuse
    return passes, [f"profiles_dir={runs / 'profiles'}"] if count else [], runs if count else None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    interrupt_on_sigterm()  # stopped by timeout or kill: the finished runs are analysed
    runs = Path(args.runs) / time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else runs
    out.mkdir(parents=True, exist_ok=True)
    passes, profile_dir, passes_from = profiles(args, runs)
    if passes.count:
        passes.measure_next()  # the first pass sets the rates
    base = [*QUIET, *profile_dir, *args.extra]
    plans = plan_traces(
        args.traces, args.load, args.num_requests, args.max_model_len, base, runs, args.reuse
    )
    planned = schedule(list(plans), args.policies, args.repeats, args.noise)

    def real(run):
        name = f"{run.trace}/{run.folder}"
        if args.reuse is not None:
            return reused_run(args.reuse, name)
        measure([*plans[run.trace].pair(run.policy), "mode=real"], runs / name, args.in_process)
        return runs / name

    before = spread_evenly(passes.count, len(planned))[1:] if passes.count else []
    done = run_schedule(planned, real, before, passes.measure_next, args.reuse is not None)
    pass_dirs = []
    if passes_from is not None:
        found = sorted((passes_from / "profile-passes").glob("*"), key=lambda d: int(d.name))
        pass_dirs = [d.resolve() for d in found]
    models = pair_models(plans, args.policies)
    write_report(args, runs, out, plans, done, models, pass_dirs)


def check_profile(models: dict, ran: list) -> tuple[float | None, list[str]]:
    """The latency model's fit to its own profile (over 5%: the machine's speed
    moved while it was profiled, and every error carries that) and the runs
    measured on another machine than their profile; both printed."""
    fits = [m.fit_rel_error for m in models.values() if hasattr(m, "fit_rel_error")]
    profile_fit = max(fits) if fits else None
    if profile_fit is not None:
        print(fit_line(profile_fit))
    mismatches = machine_mismatches([(run, models[t, p]) for t, p, run in ran])
    for line in mismatches:
        print(line, flush=True)
    return profile_fit, mismatches


def write_report(args, runs: Path, out: Path, plans, done, models, pass_dirs: list[Path]) -> None:
    """Analyse every pair; write, print and log the tables."""
    profile_fit, mismatches = check_profile(models, done.ran)
    speeds = RunSpeeds(done.ran, models)
    found = analyse(
        plans, args.policies, done.reals, models, speeds, args.repeats, pass_dirs, runs, args.reuse
    )
    table = pd.DataFrame(found.rows)
    effects, orders = policy_effects(found.by_trace, args.policies[0])
    tables = dict(
        policy_effects=effects,
        policy_orders=orders,
        steps_by_size=steps_by_size(found.by_size),
        run_speeds=speeds.table,
        speed_summary=speed_summary(speeds.table),
    )
    meta = dict(
        date=time.strftime("%Y-%m-%d"),
        **{k: getattr(args, k) for k in ("load", "num_requests", "max_model_len", "extra")},
        runs=str(runs.relative_to(ROOT)) if runs.is_relative_to(ROOT) else str(runs),
        reused_real_runs=str(args.reuse) if args.reuse else None,
        repeats=args.repeats,
        profile_passes=len(pass_dirs),
        profile_fit_rel_error=profile_fit,
        machine_mismatches=mismatches,
        profile_reference=sorted(
            {profile_reference_key(models[t, p]) for t, p, r in done.ran if r in speeds.profiled}
        ),
        simulated_with=sorted(map(str, found.sources)),
        interrupted=done.interrupted,
    )
    markdown = fidelity_markdown(table, tables, mismatches, args.policies[0])
    write_tables(out, found.rows, tables, meta, markdown)
    plot(found.plotted, out / "fidelity.png")
    write_manifest(out, profiles=[m.path for m in models.values() if hasattr(m, "path")])
    print(errors_markdown(table) + "\n" + effects_markdown(effects, orders))
    del tables["speed_summary"]
    log_experiment(
        args.wandb,
        runs,
        "fidelity",
        meta,
        tables=dict(fidelity=table, **tables),
        images=dict(fidelity_plots=out / "fidelity.png"),
    )
    print(f"wrote {out}")
