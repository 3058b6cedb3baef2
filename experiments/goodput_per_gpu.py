"""Goodput per GPU of deployments of one model on a fixed number of GPUs: how
to split them into replicas of tensor-parallel groups (e.g. Llama-3-70B on
eight H100s as TP2 x 4, TP4 x 2 or TP8 x 1), in simulation.

For each deployment: its capacity (the highest rate its trace is sustained at,
``testbed.capacity``), then under each SLO the highest rate at which the
SLO's percentile of TTFT and of TPOT meet their targets (bisected between 0
and the capacity), divided by the deployment's GPUs.

    python -m experiments.goodput_per_gpu [--model llama3-70b] [--hardware h100]
        [--deployments 2x4 4x2 8x1] [--trace azure_conv] [--num-requests 1500]
        [--slo tight:0.3:0.025 loose:1:0.05] [--percentile p90]

(``TPxREPLICAS``; ``name:TTFT_s:TPOT_s``). Prints the table; writes
``goodput_per_gpu.csv``, ``.json`` and ``manifest.json`` to ``--out``
(``outputs/goodput_per_gpu``).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pandas as pd

from experiments.manifest import write_manifest
from testbed.capacity import find_capacity
from testbed.config_schema import compose_config
from testbed.errors import InputError
from testbed.job import run_from_config
from testbed.search.slo import SLO, parse_slo

BISECTIONS = 7


def slo_rate(common, capacity, slo: SLO, out: Path) -> tuple[float, dict | None]:
    """The highest rate (req/s, within 1/2^BISECTIONS of the capacity) meeting the SLO,
    and that run's metrics (0 and None where even the lowest rate misses it)."""
    lo, hi, best = 0.0, capacity, None
    shutil.rmtree(out, ignore_errors=True)  # a run folder is claimed once
    for i in range(BISECTIONS):
        rate = (lo + hi) / 2
        m = run_from_config(compose_config([*common, f"trace.rate={rate}"]), out / f"bisect{i}")
        if slo.met_by(m):
            lo, best = rate, m
        else:
            hi = rate
    return lo, best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.goodput_per_gpu", description=__doc__)
    ap.add_argument("--model", default="llama3-70b")
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--deployments", nargs="+", default=["2x4", "4x2", "8x1"])
    ap.add_argument("--trace", default="azure_conv")
    ap.add_argument("--num-requests", type=int, default=1500)
    ap.add_argument("--slo", nargs="+", default=["tight:0.3:0.025", "loose:1:0.05"])
    ap.add_argument("--percentile", default="p90", choices=["p50", "p90", "p99"])
    ap.add_argument("--out", type=Path, default=Path("outputs/goodput_per_gpu"))
    a = ap.parse_args(argv)
    slos = [parse_slo(f"{s}@{a.percentile}", "--slo") for s in a.slo]
    rows = []
    for dep in a.deployments:
        tp, replicas = (int(x) for x in dep.split("x"))
        gpus = tp * replicas
        common = [
            "mode=sim",
            f"model={a.model}",
            f"hardware={a.hardware}",
            f"trace={a.trace}",
            f"trace.num_requests={a.num_requests}",
            f"engine.tensor_parallel_size={tp}",
            f"cluster.num_replicas={replicas}",
            "cluster.router=least_outstanding_tokens",
            "logging=disabled",
            "progress=false",
            "plots=false",
        ]
        cfg = compose_config(common)
        try:
            capacity = find_capacity(cfg)
        except (ValueError, InputError) as e:  # e.g. its weights leave no room for a KV cache
            print(f"TP{tp} x {replicas}: {e}")
            rows.append(dict(deployment=f"TP{tp} x {replicas}", tensor_parallel_size=tp,
                             replicas=replicas, gpus=gpus, slo=None, note=str(e)))  # fmt: skip
            continue
        print(f"TP{tp} x {replicas}: capacity {capacity:.3f} req/s ({capacity / gpus:.3f} per GPU)")
        for slo in slos:
            name, ttft_s, tpot_s = slo.name, slo.ttft_s, slo.tpot_s
            rate, m = slo_rate(common, capacity, slo, a.out / f"{dep}-{name}")
            row = dict(
                deployment=f"TP{tp} x {replicas}",
                tensor_parallel_size=tp,
                replicas=replicas,
                gpus=gpus,
                slo=name,
                ttft_slo_s=ttft_s,
                tpot_slo_s=tpot_s,
                percentile=a.percentile,
                capacity_req_s=capacity,
                capacity_req_s_per_gpu=capacity / gpus,
                slo_rate_req_s=rate,
                slo_rate_req_s_per_gpu=rate / gpus,
                output_tok_s_per_gpu=m["throughput_output_tok_s_per_gpu"] if m else 0.0,
                ttft_s=m[f"ttft_s_{a.percentile}"] if m else None,
                tpot_s=m[f"tpot_s_{a.percentile}"] if m else None,
                latency_model_source=m["latency_model_source"] if m else None,
            )
            rows.append(row)
            print(
                f"  {name} (TTFT {ttft_s:g} s, TPOT {tpot_s * 1e3:g} ms at {a.percentile}): "
                f"{rate:.3f} req/s = {rate / gpus:.3f} per GPU",
                flush=True,
            )
    df = pd.DataFrame(rows)
    print(df.drop(columns=["latency_model_source", "note"], errors="ignore").to_string(index=False))
    a.out.mkdir(parents=True, exist_ok=True)
    df.to_csv(a.out / "goodput_per_gpu.csv", index=False)
    (a.out / "goodput_per_gpu.json").write_text(json.dumps(rows, indent=1, default=str))
    write_manifest(a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
