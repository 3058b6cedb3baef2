"""Simulator speed on GPU deployments: a whole trace simulated with the operator
model for Llama-3-8B TP1, Llama-3-70B TP4 and Mixtral-8x7B TP2 on H100, against
the roofline's Llama-3-8B TP1 (the simulator's GPU pricing before the operator
model) and the roofline's run of the same deployments, optionally also as a
baseline checkout runs it.

    python -m benchmarks.gpu_sim_speed [--trace azure_conv] [--repeats 2]
        [--baseline <checkout of an older commit>] [--out outputs/gpu_sim_speed]

Runs are interleaved and each configuration's median wall time kept (the
simulation alone: ``sim_wall_s``); the ratio to the roofline's TP1 run is the
figure (these machines' speed moves between minutes). Prints the table; writes
``gpu_sim_speed.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median

CONFIGS = {
    "roofline llama3-8b TP1": ["model=llama3-8b", "mode.latency_model=roofline"],
    "operators llama3-8b TP1": ["model=llama3-8b"],
    "operators llama3-70b TP4": ["model=llama3-70b", "engine.tensor_parallel_size=4"],
    "operators mixtral-8x7b TP2": ["model=mixtral-8x7b", "engine.tensor_parallel_size=2"],
    # The same deployments under the roofline: what the operator model itself costs,
    # apart from a bigger deployment's larger batches (more work per step for the
    # scheduler at the same arrivals).
    "roofline llama3-70b TP4": [
        "model=llama3-70b",
        "engine.tensor_parallel_size=4",
        "mode.latency_model=roofline",
    ],
    "roofline mixtral-8x7b TP2": [
        "model=mixtral-8x7b",
        "engine.tensor_parallel_size=2",
        "mode.latency_model=roofline",
    ],
}
BASELINE = "baseline: roofline llama3-8b TP1"


def run(checkout: Path, overrides: list[str], trace: str) -> dict:
    """One simulation by ``checkout``'s run.py; its metrics."""
    out = Path(tempfile.mkdtemp(prefix="gpu_sim_speed-"))
    cmd = [sys.executable, "run.py", "mode=sim", "hardware=h100", f"trace={trace}",
           "logging=disabled", "plots=false", "progress=false",
           f"hydra.run.dir={out}", *overrides]  # fmt: skip
    subprocess.run(cmd, cwd=checkout, check=True, capture_output=True)
    return json.loads((out / "metrics.json").read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_sim_speed", description=__doc__)
    ap.add_argument("--trace", default="azure_conv")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--baseline", type=Path, help="an older checkout (its roofline TP1 run)")
    ap.add_argument("--out", type=Path, default=Path("outputs/gpu_sim_speed"))
    a = ap.parse_args(argv)
    here = Path(__file__).resolve().parents[1]
    runs = {name: (here, o) for name, o in CONFIGS.items()}
    if a.baseline:
        runs[BASELINE] = (a.baseline.resolve(), ["model=llama3-8b"])
    walls: dict[str, list[float]] = {name: [] for name in runs}
    metrics: dict[str, dict] = {}
    for _ in range(a.repeats):
        for name, (checkout, overrides) in runs.items():
            m = run(checkout, overrides, a.trace)
            walls[name].append(m["sim_wall_s"])
            metrics[name] = m
    reference = median(walls["roofline llama3-8b TP1"])
    rows = []
    for name, w in walls.items():
        m = metrics[name]
        rows.append(
            dict(
                config=name,
                requests=m["num_requests"],
                steps=m["num_steps"],
                sim_wall_s=median(w),
                walls=w,
                vs_roofline_tp1=median(w) / reference,
                requests_per_wall_s=m["num_requests"] / median(w),
                latency_model=m["latency_model"],
            )
        )
        print(
            f"{name:<34} {m['num_requests']:>7} requests {m['num_steps']:>8} steps "
            f"{median(w):7.2f} s  x{median(w) / reference:.2f} of roofline TP1",
            flush=True,
        )
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "gpu_sim_speed.json").write_text(
        json.dumps({"trace": a.trace, "repeats": a.repeats, "rows": rows}, indent=1)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
