"""Simulator speed with clusters: one replica, 8 colocated replicas and 4P4D
(disaggregated), each on the full Azure 2023 conv trace (19,366 requests) with
Llama-3-8B on H200 specs; simulated requests per wall-second of the simulation
and the process's peak memory, each configuration in its own process. The
single replica is the peer: a cluster should stay within 2x of its speed.

    python benchmarks/cluster_sim_speed.py [--repeats 3] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

from common import write_results

CLUSTERS = {
    "1 replica": [],
    "8 replicas": ["cluster.num_replicas=8", "cluster.router=least_outstanding"],
    "4P4D": ["cluster=disagg", "cluster.num_prefill=4", "cluster.num_decode=4"],
    "4P4D, fast path off": [
        "cluster=disagg", "cluster.num_prefill=4", "cluster.num_decode=4",
        "mode.fast_forward=false",
    ],
}  # fmt: skip
BASE = ["mode=sim", "trace=azure_conv", "model=llama3-8b", "hardware=h200", "policy=fcfs"]


def child(overrides: list[str]) -> None:
    """In the child: simulate and print one JSON line (wall time, peak RSS)."""
    from testbed.build import load_requests, model_spec
    from testbed.config_schema import compose_config
    from testbed.modes.sim import simulate

    cfg = compose_config([*BASE, *overrides])
    spec = model_spec(cfg.model)
    _, requests = load_requests(cfg, spec)
    t0 = time.perf_counter()
    result, extra = simulate(cfg, requests, spec)
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    done = sum(1 for r in result.requests if r.finish_time is not None)
    print(json.dumps(dict(requests=len(requests), finished=done, wall_s=wall, peak_bytes=peak)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/cluster_sim_speed.json")
    ap.add_argument("--child", nargs="*", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        child(a.child)
        return
    walls: dict[str, list[float]] = {name: [] for name in CLUSTERS}
    info: dict[str, dict] = {}
    for _ in range(a.repeats):  # interleaved: the machine's drift moves all alike
        for name, overrides in CLUSTERS.items():
            out = subprocess.run(
                [sys.executable, __file__, "--child", *overrides],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            info[name] = json.loads(out.stdout.strip().splitlines()[-1])
            walls[name].append(info[name]["wall_s"])
    base = statistics.median(walls["1 replica"])
    rows = []
    for name in CLUSTERS:
        wall = statistics.median(walls[name])
        rows.append(
            dict(
                cluster=name,
                requests=info[name]["requests"],
                finished=info[name]["finished"],
                wall_s=wall,
                requests_per_wall_s=info[name]["requests"] / wall,
                slowdown_vs_one_replica=wall / base,
                peak_mb=info[name]["peak_bytes"] / 2**20,
            )
        )
        r = rows[-1]
        print(
            f"{name:<22} {r['wall_s']:7.2f} s  {r['requests_per_wall_s']:8.0f} req/s  "
            f"x{r['slowdown_vs_one_replica']:.2f}  peak {r['peak_mb']:.0f} MB"
        )
    write_results(a.out, "cluster_sim_speed", rows, repeats=a.repeats, trace="azure_conv")


if __name__ == "__main__":
    main()
