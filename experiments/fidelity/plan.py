"""Which runs an experiment makes: each trace's rate, the real runs' order, and
where the profiler passes go between them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from testbed.capacity import find_capacity
from testbed.config_schema import compose_config

QUIET = ["logging=disabled", "progress=false", "plots=false"]  # every run's, real and simulated


@dataclass(frozen=True)
class TracePlan:
    """One trace of the experiment: its capacity in simulation, the rate it is
    replayed at, and the overrides every run of it is composed from."""

    name: str
    capacity: float
    rate: float
    common: list[str]

    def pair(self, policy: str) -> list[str]:
        """What a pair's runs, real and simulated, are composed from."""
        return [*self.common, f"policy={policy}", f"trace.rate={self.rate}"]


@dataclass(frozen=True)
class RealRun:
    """One real run of the schedule: its pair, its round (0-based) and its folder."""

    trace: str
    policy: str
    repeat: int
    folder: str


def trace_overrides(spec: str, num_requests: int, max_model_len: int, base: list[str]):
    """A trace given as ``name`` or ``name:option=value,...`` (options for that
    trace alone) as its name and the overrides of its runs."""
    name, _, opts = spec.partition(":")
    own = [f"trace.{kv}" for kv in opts.split(",") if kv]
    common = [
        f"trace={name}",
        f"trace.num_requests={num_requests}",
        f"trace.max_model_len={max_model_len}",
        *own,
        *base,
    ]
    return name, common


def capacity(common: list[str]) -> float:
    """The highest arrival rate the engine sustains on this trace, in simulation
    (``testbed.capacity``, what ``python run.py load=...`` scales a trace by)."""
    cfg = compose_config([*common, "mode=sim"])
    return find_capacity(cfg)


def reused_rates(reuse: Path, trace: str) -> tuple[float, float]:
    """The capacity and rate an earlier invocation replayed ``trace`` at."""
    known = reuse / trace / "rate.json"
    if not known.exists():
        raise SystemExit(
            f"--reuse: {known} is missing; write the rate the real runs were "
            'replayed at: {"capacity_req_s": ..., "rate_req_s": ...}'
        )
    rates = json.loads(known.read_text())
    return rates["capacity_req_s"], rates["rate_req_s"]


def plan_traces(
    specs: list[str],
    load: float,
    num_requests: int,
    max_model_len: int,
    base: list[str],
    runs: Path,
    reuse: Path | None,
) -> dict[str, TracePlan]:
    """Each trace at ``load`` of its capacity in simulation (with ``reuse``, at the
    rate its real runs were replayed at), recorded in ``runs/<trace>/rate.json``."""
    plans = {}
    for spec in specs:
        name, common = trace_overrides(spec, num_requests, max_model_len, base)
        if reuse is not None:
            cap, rate = reused_rates(reuse, name)
        else:
            cap = capacity(common)
            rate = round(load * cap, 3)
        (runs / name).mkdir(parents=True, exist_ok=True)
        (runs / name / "rate.json").write_text(
            json.dumps(dict(capacity_req_s=cap, rate_req_s=rate)) + "\n"
        )
        print(f"{name}: capacity {cap:.3f} req/s in simulation; replaying at {rate} req/s")
        plans[name] = TracePlan(name, cap, rate, common)
    return plans


def rounds(policies: list[str], repeats: int) -> list[list[str]]:
    """The order of the real runs of one trace: ``repeats`` rounds of every
    policy once, every other round reversed (fcfs sjf vtc, vtc sjf fcfs, ...).
    Runs in one fixed order give the policies a drift of the machine's speed as
    effects; reversed rounds give each policy the same mean position over an
    even number of rounds, so a steady drift cancels from a pair's mean run and
    from the policy effects."""
    return [list(policies) if k % 2 == 0 else list(reversed(policies)) for k in range(repeats)]


def run_name(policy: str, repeat: int) -> str:
    """The folder of a pair's ``repeat``-th real run (0-based)."""
    return f"{policy}-real" if repeat == 0 else f"{policy}-real-{repeat + 1}"


def schedule(traces: list[str], policies: list[str], repeats: int, noise: bool) -> list[RealRun]:
    """Every real run in the order it runs: trace by trace, in :func:`rounds`; with
    ``noise`` and one round, the first policy once more (the noise floor)."""
    order = rounds(policies, repeats)
    runs = []
    for trace in traces:
        for repeat, round_ in enumerate(order):
            runs += [RealRun(trace, p, repeat, run_name(p, repeat)) for p in round_]
        if noise and repeats == 1:
            runs.append(RealRun(trace, policies[0], 1, run_name(policies[0], 1)))
    return runs


def spread_evenly(passes: int, runs: int) -> list[int]:
    """Before which real runs (``runs``: after the last) ``passes`` profiler
    passes go: the first before any run, the last after all, the rest between,
    evenly."""
    if passes == 1:
        return [0]
    return [round(i * runs / (passes - 1)) for i in range(passes)]
