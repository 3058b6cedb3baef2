"""A million-request run with default settings: its wall time against its
simulation time, and its memory per request beyond the trace file.

Writes a synthetic trace of ``--requests`` rows to a CSV file (our own format,
with tenants, priorities, SLOs and shared prefixes), then runs, as a user would,

    python run.py trace=csv trace.path=<file> trace.rate=<rate>

with every other setting at its default (offline W&B logging, plots, progress
bar), and the same command on a file of the first ``--small`` rows (the peer
in the same run: what the process costs without the requests). Each run's peak
memory is its process's maximum resident set size (``getrusage``).

* ``time_ratio``: the process's wall time over ``sim_wall_s`` (the simulation
  itself, from ``metrics.json``): what writing, summarising and logging cost.
* ``bytes_per_request``: (peak of the big run - peak of the small run - the
  trace files' difference in size) / (the difference in requests).

    python benchmarks/million_requests.py [--requests 1000000] [--rates 5.6 2]
        [--out benchmarks/results/million_requests.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import write_results

from traces.export import export_csv
from traces.synthetic import synthetic_trace

ROOT = Path(__file__).resolve().parent.parent
SHARED_PREFIX = {"num_prefixes": 8, "tokens": 512, "fraction": 0.3}


def write_trace(path: Path, num_requests: int) -> Path:
    """The benchmark's trace: the default synthetic workload (two tenants with SLOs,
    log-normal lengths) with shared system prompts, at 1 req/s (each run sets its rate)."""
    if path.exists():
        return path
    trace = synthetic_trace(num_requests, rate=1.0, seed=0, shared_prefix=SHARED_PREFIX)
    return export_csv(trace, path)


def run(trace: Path, rate: float, out_dir: Path) -> dict:
    """``python run.py`` on the trace at ``rate``, in a child process; its wall
    time, peak memory and metrics."""
    cmd = [
        sys.executable,
        str(ROOT / "run.py"),
        "trace=csv",
        f"trace.path={trace}",
        f"trace.rate={rate}",
        f"hydra.run.dir={out_dir}",
    ]
    env = {**os.environ, "WANDB_DIR": str(out_dir.parent / "wandb")}
    start = time.perf_counter()
    # A fresh interpreter per run: getrusage(RUSAGE_CHILDREN) is the peak of all
    # children so far, so measure each run from a process of its own.
    code = (
        "import resource, subprocess, sys, json; "
        "rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode; "
        "print(json.dumps([rc, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *cmd], cwd=ROOT, env=env, capture_output=True, text=True
    )
    wall = time.perf_counter() - start
    if done.returncode != 0 or not done.stdout.strip():
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    rc, peak_kib = json.loads(done.stdout.strip().splitlines()[-1])
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd)} exited with {rc}:\n{done.stderr[-3000:]}")
    metrics = json.loads((out_dir / "metrics.json").read_text())
    return {"wall_s": wall, "peak_bytes": peak_kib * 1024, "metrics": metrics}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=1_000_000)
    p.add_argument("--small", type=int, default=1_000, help="the peer run's requests")
    p.add_argument(
        "--rates",
        type=float,
        nargs="+",
        default=[5.6, 2.0],
        help="req/s; the default model on this CPU's profile serves about 8 (5.6 is a load "
        "of about 0.7, 2 a light load with a few requests per step)",
    )
    p.add_argument("--work", default=str(ROOT / "outputs" / "bench_million"))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "million_requests.json"))
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    trace = write_trace(work / f"trace_{args.requests}.csv", args.requests)
    small_trace = write_trace(work / f"trace_{args.small}.csv", args.small)
    file_bytes = trace.stat().st_size - small_trace.stat().st_size
    rows = []
    stamp = time.strftime("%H%M%S")
    for rate in args.rates:
        small = run(small_trace, rate, work / f"{stamp}_small_{rate:g}")
        big = run(trace, rate, work / f"{stamp}_big_{rate:g}")
        m = big["metrics"]
        beyond = big["peak_bytes"] - small["peak_bytes"] - file_bytes
        rows.append(
            {
                "rate_req_s": rate,
                "requests": args.requests,
                "num_steps": m["num_steps"],
                "sim_wall_s": m["sim_wall_s"],
                "run_wall_s": m["wall_s"],
                "process_wall_s": big["wall_s"],
                "small_process_wall_s": small["wall_s"],
                "time_ratio": big["wall_s"] / m["sim_wall_s"],
                "peak_bytes": big["peak_bytes"],
                "small_peak_bytes": small["peak_bytes"],
                "trace_file_bytes": trace.stat().st_size,
                "bytes_per_request": beyond / (args.requests - args.small),
                "steps_per_request": m["num_steps"] / args.requests,
                "overloaded": m["overloaded"],
            }
        )
    print(
        f"{'rate':>6} {'steps':>10} {'sim s':>8} {'process s':>10} {'ratio':>6} "
        f"{'peak MB':>8} {'B/request':>10}"
    )
    for r in rows:
        print(
            f"{r['rate_req_s']:>6g} {r['num_steps']:>10} {r['sim_wall_s']:>8.1f} "
            f"{r['process_wall_s']:>10.1f} {r['time_ratio']:>6.2f} "
            f"{r['peak_bytes'] / 1e6:>8.0f} {r['bytes_per_request']:>10.0f}"
        )
    write_results(
        args.out,
        "million_requests",
        rows,
        command=" ".join(["python", "benchmarks/million_requests.py", *sys.argv[1:]]),
        peak_rss_of="the run.py process (getrusage ru_maxrss, Linux: KiB)",
        cpu_count=os.cpu_count(),
    )


if __name__ == "__main__":
    main()
