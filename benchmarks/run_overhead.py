"""What a run costs beyond its simulation: the full Azure 2023 conv trace (19,366
requests, about 480,000 steps) with Llama-3-8B on H200 specs under FCFS, each
setting in its own process, as ``python run.py`` runs it. Per setting: the
simulation's wall time (the peer), the run's own time (``run_from_config``:
simulate, write the run directory, plot, log to W&B) and the whole process's,
with the run directory's writing and the wait for W&B's logging timed apart
(W&B starts in a child process when the run starts: what the run waits for is
what is left at its end).

    python benchmarks/run_overhead.py [--repeats 3] [--out FILE.json] [--baseline DIR]

``--baseline DIR``: also time an older checkout of the project at DIR (``git
worktree add DIR <commit>``) in the same interleaved rounds (its settings but
``outputs.steps_format``, which it may not have), with this environment.

Targets (issue 42): the run within 1.5x the simulation and the process within
2.5x with defaults on (plots, W&B offline); W&B at most 1 s of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import write_results

SETTINGS = {
    "no plots, no W&B": ["plots=false", "logging=disabled"],
    "plots, no W&B": ["logging=disabled"],
    "defaults (plots, W&B offline)": [],
    "defaults, steps as parquet": ["outputs.steps_format=parquet"],
}
BASE = ["mode=sim", "trace=azure_conv", "model=llama3-8b", "hardware=h200", "policy=fcfs"]


def child(overrides: list[str], run_dir: str) -> None:
    """In the child: one run, timed by phase; prints one JSON line."""
    from testbed import job
    from testbed.config_schema import compose_config

    spent = {"write_s": 0.0, "wandb_s": 0.0}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t

        return wrapper

    job.write_run_dir = timed("write_s", job.write_run_dir)
    if hasattr(job, "WandbProcess"):  # W&B in a child process: the wait for it at the end
        job.WandbProcess.log = timed("wandb_s", job.WandbProcess.log)
    else:  # W&B in the run's process (before 2026-12-05)
        job.log_run = timed("wandb_s", job.log_run)
    cfg = compose_config([*BASE, "progress=false", *overrides])
    t = time.perf_counter()
    metrics = job.run_from_config(cfg, run_dir)
    run_s = time.perf_counter() - t
    print(json.dumps(dict(sim_s=metrics["sim_wall_s"], run_s=run_s, **spent)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/run_overhead.json")
    ap.add_argument("--child", nargs="*", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    ap.add_argument("--baseline", type=Path, help="an older checkout to time beside this one")
    a = ap.parse_args()
    if a.child is not None:
        child(a.child, a.run_dir)
        return
    here = Path(__file__).resolve().parents[1]
    trees = {"": here}
    if a.baseline is not None:
        trees["baseline: "] = a.baseline.resolve()
    jobs = [
        (prefix + name, tree, overrides)
        for prefix, tree in trees.items()
        for name, overrides in SETTINGS.items()
        if not (prefix and any(o.startswith("outputs.") for o in overrides))
    ]
    got: dict[str, list[dict]] = {name: [] for name, _, _ in jobs}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.repeats):  # interleaved: the machine's drift moves all alike
            for j, (name, tree, overrides) in enumerate(jobs):
                run_dir = Path(tmp) / f"{i}-{j}"
                env = {**os.environ, "PYTHONPATH": str(tree)}  # that checkout's packages
                t = time.perf_counter()
                out = subprocess.run(
                    [sys.executable, __file__, "--run-dir", str(run_dir), "--child", *overrides],
                    capture_output=True, text=True, check=True, cwd=tree, env=env,
                )  # fmt: skip
                process_s = time.perf_counter() - t
                row = json.loads(out.stdout.strip().splitlines()[-1])
                got[name].append(dict(row, process_s=process_s))
    rows = []
    for name, runs in got.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        rows.append(
            dict(
                setting=name,
                **med,
                run_vs_sim=med["run_s"] / med["sim_s"],
                process_vs_sim=med["process_s"] / med["sim_s"],
            )
        )
    heads = f"{'sim':>6} {'write':>6} {'W&B':>6} {'run':>6} {'process':>8}"
    print(f"{'setting':<42} {heads}  run/sim  process/sim")
    for r in rows:
        print(
            f"{r['setting']:<42} {r['sim_s']:6.2f} {r['write_s']:6.2f} {r['wandb_s']:6.2f} "
            f"{r['run_s']:6.2f} {r['process_s']:8.2f}  {r['run_vs_sim']:7.2f}  "
            f"{r['process_vs_sim']:11.2f}"
        )
    baseline = None
    if a.baseline is not None:
        from experiments.manifest import git

        baseline = git("-C", str(a.baseline), "rev-parse", "HEAD")
    write_results(
        a.out, "run_overhead", rows, repeats=a.repeats, trace="azure_conv", baseline=baseline
    )


if __name__ == "__main__":
    main()
