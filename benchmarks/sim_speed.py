"""Simulator speed: simulated requests per wall-second, and how wall time grows.

The full Azure 2023 conv trace (19,366 requests, real arrivals) through FCFS
with chunked prefill and prefix caching on, Llama-3-8B on an H200 (the configs
`model=llama3-8b hardware=h200`), then the trace repeated back to back 4x and
16x. The peer in the same run is this simulator with its fast path off
(stepping every engine step); Vidur's speed on the same trace from PEERS.md
(about 505-545 simulated requests per second for Llama-2-70B; 600-1,070 on
10,000-request runs on this kind of machine) is printed for reference.

    python benchmarks/sim_speed.py [--scales 1 4 16] [--out benchmarks/results/sim_speed.json]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd
from common import write_results

from testbed.build import model_spec
from testbed.config_schema import compose_config
from testbed.metrics.summary import summarize
from testbed.modes.sim import simulate
from testbed.workload import to_requests
from traces import load_trace

ROOT = Path(__file__).resolve().parent.parent

OVERRIDES = [
    "trace=azure_conv",
    "model=llama3-8b",
    "hardware=h200",
    "policy=fcfs",
    "logging=disabled",
    "progress=false",
    "plots=false",
]


def repeat(trace: pd.DataFrame, times: int) -> pd.DataFrame:
    """The trace ``times`` times back to back (the same load, ``times`` x longer)."""
    span = trace["arrival_s"].max() + 1.0
    parts = [trace.assign(arrival_s=trace["arrival_s"] + i * span) for i in range(times)]
    out = pd.concat(parts, ignore_index=True)
    out.attrs = dict(trace.attrs)
    return out


def measure(cfg, trace: pd.DataFrame, spec) -> dict:
    """Simulate ``trace`` under ``cfg``: its size, the simulator's wall time, the outcome."""
    requests = to_requests(trace, seed=cfg.seed)
    t0 = time.perf_counter()
    result, extra = simulate(cfg, requests, spec)
    wall = time.perf_counter() - t0
    summary = summarize(result)
    return dict(
        requests=len(requests),
        finished=summary["num_finished"],
        steps=len(result.steps),
        jumped_steps=result.num_jumped_steps,
        max_waiting=int(result.steps.column("num_waiting").max()),
        sim_wall_s=result.wall_s,
        wall_s=wall,
        req_per_wall_s=len(requests) / result.wall_s,
        simulated_s=result.duration_s,
        mean_ttft_s=summary["ttft_s_mean"],
        mean_e2e_s=summary["e2e_s_mean"],
        latency_model=extra["latency_model"],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scales", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/sim_speed.json"))
    args = ap.parse_args()
    cfg = compose_config(OVERRIDES)
    slow_cfg = compose_config([*OVERRIDES, "mode.fast_forward=false"])
    spec = model_spec(cfg.model)
    t0 = time.perf_counter()
    base = load_trace("azure_conv")
    load_s = time.perf_counter() - t0
    rows = []
    for scale in args.scales:
        rows.append(dict(scale=scale, fast_path=True, **measure(cfg, repeat(base, scale), spec)))
    rows.append(dict(scale=1, fast_path=False, **measure(slow_cfg, base, spec)))
    print(f"trace load: {load_s:.3f} s ({len(base)} requests)")
    print(
        f"{'scale':>5} {'fast':>5} {'requests':>9} {'steps':>10} {'sim wall s':>10} "
        f"{'req/wall-s':>11} {'simulated s':>12}"
    )
    for r in rows:
        print(
            f"{r['scale']:>5} {r['fast_path']!s:>5} {r['requests']:>9} {r['steps']:>10} "
            f"{r['sim_wall_s']:>10.2f} {r['req_per_wall_s']:>11,.0f} {r['simulated_s']:>12,.0f}"
        )
    fast1 = next(r for r in rows if r["scale"] == 1 and r["fast_path"])
    slow1 = next(r for r in rows if not r["fast_path"])
    print(
        f"fast path speed-up over stepping: {slow1['sim_wall_s'] / fast1['sim_wall_s']:.1f}x; "
        f"vs Vidur's ~545-1,070 req/s (PEERS.md): {fast1['req_per_wall_s'] / 1070:.1f}-"
        f"{fast1['req_per_wall_s'] / 545:.1f}x"
    )
    write_results(
        args.out,
        "sim_speed",
        rows,
        overrides=OVERRIDES,
        trace_load_s=load_s,
        target_req_per_wall_s=10_000,
    )


if __name__ == "__main__":
    main()
