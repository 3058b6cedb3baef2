"""Simulator speed with clusters: one replica, 8 colocated replicas and 4P4D
(disaggregated), each on the full Azure 2023 conv trace (19,366 requests) with
Llama-3-8B on H200 specs; simulated requests per wall-second of the simulation
and the process's peak memory, each configuration in its own process. The
single replica is the peer: a cluster should stay within 2x of its speed.

    python benchmarks/cluster_sim_speed.py [--repeats 3] [--out FILE.json]
        [--baseline CHECKOUT] [--only NAME ...]

``--baseline``: another checkout of the project (``git worktree add DIR REV``),
its simulator run interleaved with this one's on the same configurations: the
ratio says whether a change made the simulator slower on this noisy machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

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


def baseline_sha(root: Path) -> str | None:
    """The commit a baseline checkout is at (its path is this machine's own)."""
    done = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    return done.stdout.strip() or None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/cluster_sim_speed.json")
    ap.add_argument("--baseline", type=Path, help="another checkout, run interleaved")
    ap.add_argument("--only", nargs="*", choices=sorted(CLUSTERS), help="configurations")
    ap.add_argument("--child", nargs="*", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        child(a.child)
        return
    names = [n for n in CLUSTERS if not a.only or n in a.only or n == "1 replica"]
    trees = {"": Path(__file__).resolve().parent.parent}
    if a.baseline is not None:
        trees["baseline"] = a.baseline.resolve()
    walls = {(tree, name): [] for tree in trees for name in names}
    info: dict[str, dict] = {}
    for _ in range(a.repeats):  # interleaved: the machine's drift moves all alike
        for name in names:
            for tree, root in trees.items():
                out = subprocess.run(
                    [sys.executable, str(root / "benchmarks" / Path(__file__).name),
                     "--child", *CLUSTERS[name]],
                    capture_output=True, text=True, check=True, cwd=root,
                    env={**os.environ, "PYTHONPATH": str(root)},
                )  # fmt: skip
                got = json.loads(out.stdout.strip().splitlines()[-1])
                if not tree:
                    info[name] = got
                walls[tree, name].append(got["wall_s"])
    base = statistics.median(walls["", "1 replica"])
    rows = []
    for name in names:
        wall = statistics.median(walls["", name])
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
        line = (
            f"{name:<22} {r['wall_s']:7.2f} s  {r['requests_per_wall_s']:8.0f} req/s  "
            f"x{r['slowdown_vs_one_replica']:.2f}  peak {r['peak_mb']:.0f} MB"
        )
        if a.baseline is not None:
            r["baseline_wall_s"] = statistics.median(walls["baseline", name])
            r["speed_vs_baseline"] = r["baseline_wall_s"] / wall
            line += f"  baseline {r['baseline_wall_s']:.2f} s (x{r['speed_vs_baseline']:.2f})"
        print(line)
    write_results(
        a.out,
        "cluster_sim_speed",
        rows,
        repeats=a.repeats,
        trace="azure_conv",
        baseline_git_sha=baseline_sha(a.baseline) if a.baseline is not None else None,
    )


if __name__ == "__main__":
    main()
