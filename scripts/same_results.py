"""Check that a change leaves every result as it was: record a fixed set of runs,
change the code, record them again, compare.

    python scripts/same_results.py record outputs/same/before
    # ... change the code ...
    python scripts/same_results.py record outputs/same/after
    python scripts/same_results.py compare outputs/same/before outputs/same/after

The set: every bundled policy simulated on the full Azure conv trace (Llama-3-8B
on an H200's profile, 8 tenants, 3 priority classes) and on Mooncake conv (the
default model on this CPU's profile, 4 tenants, 3 priority classes); four
replicas; prefix affinity on four replicas and disaggregated prefill/decode
(2P2D, every prompt moved, and the uncached-prompt decider) on Mooncake conv; a
capacity search (``load=``); a run stepped without fast-forward at a
latency scale; and a short real run with greedy sampling, twice. Simulations
must agree field for field (``metrics.json`` but for wall-clock fields,
``requests.csv`` and ``steps.csv`` byte for byte); real runs in their output
token ids (times differ run to run). Runs go through ``run.py``, the stable
interface, so the script outlives the code it checks.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ["fcfs", "sjf", "srpt", "priority", "edf", "vtc", "mlfq", "cache_aware_sjf"]
QUIET = ["logging=disabled", "plots=false", "progress=false"]
AZURE = ["trace=azure_conv", "model=llama3-8b", "hardware=h200"]
TENANTS = ["trace.num_tenants=8", "trace.priority_classes=3"]
MOONCAKE = ["trace=mooncake_conv", "trace.num_tenants=4", "trace.priority_classes=3"]

SIM_RUNS: dict[str, list[str]] = {
    **{f"azure_{p}": ["mode=sim", f"policy={p}", *AZURE, *TENANTS] for p in POLICIES},
    **{f"mooncake_{p}": ["mode=sim", f"policy={p}", *MOONCAKE] for p in POLICIES},
    "azure_replicas4": ["mode=sim", "policy=vtc", *AZURE, *TENANTS, "cluster=replicas4"],
    "mooncake_affinity4": [
        "mode=sim",
        *MOONCAKE,
        "cluster=replicas4",
        "cluster.router=prefix_affinity",
    ],
    "mooncake_disagg": [
        "mode=sim",
        *MOONCAKE,
        "cluster=disagg",
        "cluster.num_prefill=2",
        "cluster.num_decode=2",
    ],
    "mooncake_disagg_uncached": [
        "mode=sim",
        *MOONCAKE,
        "cluster=disagg",
        "cluster.num_prefill=2",
        "cluster.num_decode=2",
        "cluster.decider=uncached_prompt",
        "+cluster.decider_args.threshold=1024",
    ],
    "default": ["mode=sim"],
    "stepped_scaled": [
        "mode=sim",
        "policy=sjf",
        "mode.fast_forward=false",
        "mode.latency_scale=1.3",
        "engine.max_num_seqs=16",
        "trace.num_requests=300",
        "trace.rate=6",
    ],
    "load": [
        "mode=sim",
        "policy=fcfs",
        *AZURE,
        "trace.num_requests=400",
        "load=0.7",
        "capacity_cache=null",
    ],
}
REAL_ARGS = ["mode=real", "policy=fcfs", "trace.num_requests=24", "trace.rate=8", "seed=3"]
REAL_RUNS = {"real_greedy_a": REAL_ARGS, "real_greedy_b": REAL_ARGS}
# metrics.json fields that measure this machine's wall clock, not the run's result
WALL_FIELDS = {"wall_s", "sim_wall_s", "sim_requests_per_wall_s"}


def venv_python() -> str:
    python = ROOT / ".venv" / "bin" / "python"
    return str(python) if python.exists() else sys.executable


def record(out: Path, only: list[str] | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TESTBED_NO_BOOTSTRAP": "1"}
    runs = {**SIM_RUNS, **REAL_RUNS}
    for name, args in runs.items():
        if only and name not in only:
            continue
        run_dir = out / name
        cmd = [venv_python()]
        if name in REAL_RUNS:  # greedy, and the output token ids written beside the run
            cmd += [__file__, "_greedy", str(run_dir / "tokens.json")]
        cmd += [str(ROOT / "run.py"), *args, *QUIET, f"hydra.run.dir={run_dir}"]
        print(f"{name}: {' '.join(args)}", flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)


def greedy(tokens_path: str, argv: list[str]) -> None:
    """Run ``run.py`` in this process with every trace request greedy, and write each
    request's output token ids when it ends."""
    import runpy

    sys.path.insert(0, str(ROOT))
    import testbed.workload as workload

    original = workload.to_requests
    made: list = []

    def greedy_requests(*args, **kwargs):
        requests = original(*args, **kwargs)
        for r in requests:
            r.sampling_params.temperature = 0.0
        made.extend(requests)
        return requests

    workload.to_requests = greedy_requests
    for module in list(sys.modules.values()):  # where it was imported by name already
        if getattr(module, "to_requests", None) is original:
            module.to_requests = greedy_requests

    def dump() -> None:
        Path(tokens_path).parent.mkdir(parents=True, exist_ok=True)
        tokens = {r.request_id: list(r.output_token_ids) for r in made}
        Path(tokens_path).write_text(json.dumps(tokens))

    atexit.register(dump)
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")


def compare(a: Path, b: Path) -> int:
    """Print what differs between two recordings; the number of differing runs."""
    bad = 0
    names = sorted({p.name for p in a.iterdir()} | {p.name for p in b.iterdir()})
    for name in names:
        problems = compare_run(a / name, b / name, real=name in REAL_RUNS)
        print(f"{name:<24} {'same' if not problems else '; '.join(problems)}")
        bad += bool(problems)
    # greedy real runs repeat, else comparing them means little
    if all(n in names for n in REAL_RUNS):
        first, second = (json.loads((a / n / "tokens.json").read_text()) for n in REAL_RUNS)
        if first != second:
            print(f"note: the two real runs in {a} differ from each other")
    return bad


def compare_run(a: Path, b: Path, real: bool) -> list[str]:
    if not a.exists() or not b.exists():
        return [f"missing in {a.parent if not a.exists() else b.parent}"]
    if real:
        ta, tb = (json.loads((d / "tokens.json").read_text()) for d in (a, b))
        differ = [k for k in ta if ta[k] != tb.get(k)]
        return [f"{len(differ)} of {len(ta)} requests' tokens differ"] if differ or not ta else []
    problems = []
    ma, mb = (json.loads((d / "metrics.json").read_text()) for d in (a, b))
    for key in sorted(set(ma) | set(mb)):
        if key not in WALL_FIELDS and ma.get(key, "<absent>") != mb.get(key, "<absent>"):
            before, after = ma.get(key, "<absent>"), mb.get(key, "<absent>")
            problems.append(f"metrics.{key}: {before} != {after}")
    for table in ("requests.csv", "steps.csv"):
        if (a / table).read_bytes() != (b / table).read_bytes():
            problems.append(f"{table} differs")
    return problems


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_greedy":
        greedy(sys.argv[2], sys.argv[3:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("out", type=Path)
    rec.add_argument("--only", nargs="*", help="run names (default: all)")
    cmp = sub.add_parser("compare")
    cmp.add_argument("a", type=Path)
    cmp.add_argument("b", type=Path)
    args = parser.parse_args()
    if args.cmd == "record":
        record(args.out, args.only)
    else:
        sys.exit(1 if compare(args.a, args.b) else 0)


if __name__ == "__main__":
    main()
