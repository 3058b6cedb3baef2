"""Routers on a trace with real prefix sharing: each router of
``policies/routers.py`` in simulated clusters of several sizes, the prefix-cache
hit rate, TTFT and E2E it gets.

Mooncake conv (prefix-block hashes from Kimi's service) on Llama-3-8B / H200
specs, its prompts and hash blocks scaled by ``--prompt-scale`` (so that they fit
the model's 8,192 tokens), replayed at ``--rate-per-replica`` times the cluster's
size, each replica with a ``--kv-cache-gb`` KV cache (one that holds every
prefix would make routing moot). One run per (cluster size, router).

    python -m experiments.router_comparison [--replicas 4 8] [--rate-per-replica 3]

Prints the table; writes ``router_comparison.csv``, ``.json`` and ``manifest.json``
to ``--out`` (``outputs/router_comparison``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

from experiments.manifest import write_manifest
from policies.routers import ROUTERS
from testbed.config_schema import compose_config
from testbed.job import run_from_config

METRICS = (
    "prefix_cache_hit_rate",
    "ttft_s_mean",
    "ttft_s_p99",
    "e2e_s_mean",
    "throughput_req_s",
    "num_finished",
    "num_rejected",
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m experiments.router_comparison", description=__doc__
    )
    ap.add_argument("--replicas", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--routers", nargs="+", default=sorted(ROUTERS), choices=sorted(ROUTERS))
    ap.add_argument("--rate-per-replica", type=float, default=3.0)
    ap.add_argument("--prompt-scale", type=float, default=0.25)
    ap.add_argument(
        "--kv-cache-gb", type=float, default=4.0,
        help="each replica's KV cache (a cache that holds every prefix makes routing moot)",
    )  # fmt: skip
    ap.add_argument("--trace", default="mooncake_conv")
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--out", type=Path, default=Path("outputs/router_comparison"))
    a = ap.parse_args(argv)
    rows = []
    for n in a.replicas:
        for router in a.routers:
            overrides = [
                "mode=sim",
                f"model={a.model}",
                f"hardware={a.hardware}",
                f"trace={a.trace}",
                f"trace.prompt_scale={a.prompt_scale}",
                f"trace.rate={a.rate_per_replica * n}",
                f"cluster.num_replicas={n}",
                f"cluster.router={router}",
                f"engine.kv_cache_bytes={a.kv_cache_gb * 1e9}",
                "logging=disabled",
                "progress=false",
                "plots=false",
            ]
            run_dir = a.out / f"{n}x-{router}"
            m = run_from_config(compose_config(overrides), run_dir)
            (run_dir / "steps.csv").unlink(missing_ok=True)  # tens of MB, not read here
            row = dict(replicas=n, router=router, **{k: m[k] for k in METRICS})
            rows.append(row)
            hit, ttft, p99, e2e = (row[k] for k in METRICS[:4])
            print(
                f"{n} x {router:<26} hit {hit:.3f}  TTFT mean {ttft:.3f} p99 {p99:.3f}  "
                f"E2E {e2e:.2f}",
                flush=True,
            )
    table = pd.DataFrame(rows)
    a.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(a.out / "router_comparison.csv", index=False)
    (a.out / "router_comparison.json").write_text(json.dumps(rows, indent=2) + "\n")
    write_manifest(a.out)
    print(table.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
