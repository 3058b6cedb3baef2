"""A deployment search from the sweeper's settings and the multirun's config:
the space expanded and checked, the floors and starting rates from the latency
model, the search run a round at a time through the Hydra launcher, and its
results written to the sweep folder (also when interrupted)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from testbed.build import run_trace
from testbed.errors import InputError
from testbed.search.bounds import Bounds
from testbed.search.checks import Checker, check_all
from testbed.search.report import SearchRecord, write_results
from testbed.search.search import Launch, Outcome, Search
from testbed.search.slo import parse_slos
from testbed.search.space import SET_BY_SEARCH, Deployment, Space
from testbed.signals import Terminated, exit_status, interrupt_on_sigterm, sigterm_received

WHERE = "hydra.sweeper"


def settings_of(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The sweeper's settings as plain values, each checked (errors name the field)."""
    plain = {
        k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
        for k, v in settings.items()
    }
    out = {
        "budget": plain.get("budget", 8),
        "slos": parse_slos(plain.get("slos") or [], f"{WHERE}.slos"),
        "space": Space.of(plain.get("space") or {}, f"{WHERE}.space"),
        "requests_per_instance": plain.get("requests_per_instance"),
        "rel_tol": float(plain.get("rel_tol", 0.05)),
        "probes": plain.get("probes", 4),
        "bound": bool(plain.get("bound", True)),
        "max_rounds": plain.get("max_rounds", 60),
        "start_rate_per_gpu": plain.get("start_rate_per_gpu"),
    }
    for key in ("budget", "probes", "max_rounds", "requests_per_instance"):
        if key == "requests_per_instance" and out[key] is None:
            continue
        if not (isinstance(out[key], int) and not isinstance(out[key], bool) and out[key] >= 1):
            raise InputError(f"{WHERE}.{key}={out[key]!r}: must be an integer >= 1")
    if not 0 < out["rel_tol"] < 1:
        raise InputError(f"{WHERE}.rel_tol={out['rel_tol']}: must be in (0, 1)")
    start = out["start_rate_per_gpu"]
    if start is not None and not (isinstance(start, int | float) and start > 0):
        raise InputError(f"{WHERE}.start_rate_per_gpu={start!r}: must be null or > 0 (req/s)")
    return out


def common_overrides(arguments: list[str], hydra_context, per_instance: bool) -> list[str]:
    """The command line's overrides, given to every run: none may be a sweep (the
    search picks the runs) or set what the search sets (``trace.num_requests`` too,
    with ``requests_per_instance``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create(config_loader=hydra_context.config_loader)
    for override in parser.parse_overrides(arguments):
        if per_instance and override.get_key_element().lstrip("+~") == "trace.num_requests":
            raise InputError(
                f"{override.input_line}: the search sets each run's trace.num_requests "
                f"({WHERE}.requests_per_instance x its instances); set that, or null it "
                "to give every run the trace's own"
            )
        key = override.get_key_element().lstrip("+~")
        if override.is_sweep_override():
            raise InputError(
                f"{override.input_line}: a sweep has no place in a deployment search (it "
                f"picks the runs); list a knob's values in {WHERE}.space instead"
            )
        if key in SET_BY_SEARCH:
            raise InputError(
                f"{override.input_line}: the search sets {key} for each run; choose its "
                f"values in {WHERE}.space (knobs: replicas, tensor_parallel, "
                "pipeline_parallel, split, max_num_seqs, max_num_batched_tokens, "
                "chunked_prefill, policy, router)"
            )
    return list(arguments)


def check_config(cfg: DictConfig) -> None:
    if cfg.mode.name != "sim":
        raise InputError(f"mode={cfg.mode.name}: the deployment search simulates (mode=sim)")
    if cfg.get("load") is not None:
        raise InputError(f"load={cfg.load}: the search sets each run's rate; drop load")


def job_outcome(ret) -> Outcome:
    """A finished job's metrics (its ``metrics.json``), or its error."""
    from hydra.core.utils import JobStatus

    from testbed.report.sweep_callback import job_error

    run_dir = None
    if getattr(ret, "hydra_cfg", None) is not None:
        run_dir = str(ret.hydra_cfg.hydra.runtime.output_dir)
    if ret.status != JobStatus.COMPLETED:
        return Outcome(None, job_error(ret._return_value), run_dir)
    path = Path(run_dir) / "metrics.json" if run_dir is not None else None
    if path is None or not path.is_file():
        return Outcome(
            None,
            f"no metrics.json at {path}: with a launcher on other machines, hydra.sweep.dir "
            "must be on storage this machine shares with them",
            run_dir,
        )
    return Outcome(json.loads(path.read_text()), None, run_dir)


def run_overrides(dep: Deployment, rate: float, per_instance: int | None) -> list[str]:
    """A run's overrides: its deployment's, its rate and its number of requests."""
    out = [*dep.overrides(), f"trace.rate={rate:.9g}"]
    if per_instance is not None:
        out.append(f"trace.num_requests={per_instance * dep.replicas}")
    return out


def hydra_launch(launcher, common: list[str], per_instance: int | None) -> Launch:
    """One round as one ``launcher.launch`` call; each job's folder named after its
    number, configuration and rate."""
    first = 0

    def launch(batch):
        nonlocal first
        jobs = [
            [
                *common,
                *run_overrides(dep, rate, per_instance),
                f"hydra.sweep.subdir={first + i}_{dep.id}_r{rate:.4g}",
            ]
            for i, (dep, rate) in enumerate(batch)
        ]
        returns = launcher.launch(jobs, initial_job_idx=first)
        first += len(jobs)
        return [job_outcome(r) for r in returns]

    return launch


def prepare(settings: dict[str, Any], cfg: DictConfig) -> tuple[Search, SearchRecord]:
    """The search over the space's configurations that pass the checks, and the
    record of what was ruled out before simulating."""
    started = time.perf_counter()
    deployments = settings["space"].expand()
    per_instance = settings["requests_per_instance"]
    if per_instance is not None:  # the most any run replays: the checks read all of it
        most = per_instance * max(d.replicas for d in deployments)
        cfg = OmegaConf.merge(cfg, {"trace": {"num_requests": most}})
    trace = run_trace(cfg)
    checker = Checker(cfg, trace, settings["budget"])
    kept, dropped = check_all(checker, deployments)
    if not kept:
        rules = sorted({rule for rule, _ in dropped.values()})
        first = {r: next(why for rule, why in dropped.values() if rule == r) for r in rules}
        raise InputError(
            f"{WHERE}.space: none of its {len(deployments)} configurations can run on "
            f"{settings['budget']} GPUs; e.g. "
            + "; ".join(f"{rule}: {why}" for rule, why in first.items())
        )
    bounds = Bounds(cfg, checker.stats)
    deps = {d.num: d for d in deployments}
    start = settings["start_rate_per_gpu"]
    starts = {
        n: start * deps[n].gpus if start is not None else bounds.capacity(deps[n], fit)
        for n, fit in kept.items()
    }
    misses = {}
    for n, fit in kept.items():
        requests = per_instance * deps[n].replicas if per_instance else None
        for slo in settings["slos"]:
            if (why := bounds.floor_miss(deps[n], fit, slo, requests)) is not None:
                misses[(n, slo.name)] = why
    search = Search(
        [deps[n] for n in kept],
        settings["slos"],
        starts,
        rel_tol=settings["rel_tol"],
        probes=settings["probes"],
        bound=settings["bound"],
        max_rounds=settings["max_rounds"],
        floor_misses=misses,
    )
    record = SearchRecord(
        settings=settings,
        deployments=deployments,
        dropped=dropped,
        starts=starts,
        latency_sources={n: bounds.source(deps[n]) for n in kept},
        floors=bounds.floors_off or "on",
        trace=str(cfg.trace.name),
        num_requests=len(trace),
        model=str(cfg.model.name),
        hardware=str(cfg.hardware.name),
        setup_s=time.perf_counter() - started,
    )
    return search, record


def run_search(settings_in, cfg: DictConfig, launcher, hydra_context, arguments: list[str]):
    """The sweeper's ``sweep``: search, write the results to the sweep folder and
    print the best configuration per SLO; returns the results' JSON."""
    settings = settings_of(settings_in)
    per_instance = settings["requests_per_instance"]
    common = common_overrides(arguments, hydra_context, per_instance is not None)
    check_config(cfg)
    started = time.perf_counter()
    search, record = prepare(settings, cfg)
    sweep_dir = Path(str(cfg.hydra.sweep.dir))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, sweep_dir / "multirun.yaml")
    print(
        f"deployment search: {record.settings['space'].size} configurations, "
        f"{len(search.deps)} pass the checks, {len(settings['slos'])} SLOs; "
        f"{len(search.probes)} probe first",
        flush=True,
    )
    interrupt_on_sigterm()  # a search stopped by kill or a scheduler writes what it found
    interrupted: BaseException | None = None
    try:
        search.run(logged(hydra_launch(launcher, common, per_instance), search))
    except BaseException as e:
        if sigterm_received():  # perhaps wrapped in another error by what it interrupted
            interrupted = Terminated("signal SIGTERM")
        elif isinstance(e, KeyboardInterrupt | SystemExit):  # SystemExit: a job's (run.py)
            interrupted = e
        else:
            raise
    record.wall_s = time.perf_counter() - started
    record.interrupted = interrupted is not None
    results = write_results(sweep_dir, search, record)
    if isinstance(interrupted, KeyboardInterrupt):
        print("interrupted", file=sys.stderr, flush=True)
        raise SystemExit(exit_status(interrupted)) from None
    if interrupted is not None:
        raise interrupted
    return results


def logged(launch: Launch, search: Search) -> Launch:
    """``launch`` with a line per round: its simulations and what is still live."""

    def wrapped(batch):
        live = len({n for (n, _), iv in search.intervals.items() if iv.status == "live"})
        print(
            f"deployment search round {search.round}: {len(batch)} simulations, "
            f"{live} configurations live",
            flush=True,
        )
        return launch(batch)

    return wrapped
