"""Routers on a trace with real prefix sharing: each router of
``policies/routers.py`` in simulated clusters of several sizes, the prefix-cache
hit rate, TTFT and E2E it gets.

Mooncake conv (prefix-block hashes from Kimi's service) on Llama-3-8B / H200
specs, its prompts and hash blocks scaled by ``--prompt-scale`` (so that they fit
the model's 8,192 tokens), replayed at ``--rate-per-replica`` times the cluster's
size, each replica with a ``--kv-cache-gb`` KV cache (one that holds every
prefix would make routing moot; several sizes: one table each). One run per
(cache size, cluster size, router), and with ``--bound`` the upper bound of any
router's hit rate at that load: one replica with the cluster's total cache and
its compute (steps ``1/n`` as long, ``n`` times the batch limits), serving the
same arrivals; ``of_bound`` is each router's hit rate over it. ``imbalance`` is
the busiest replica's tokens over the mean (1: evenly spread). ``--reuse``
adds the trace's own answer, without timing: the hit rate one LRU cache of
1, 4, 16 and 64 replicas' blocks (and an unbounded one) would get on its
prompts in arrival order (``trace_reuse.json``): where the cluster's total
cache is far below the reuse distances, no router can raise the hit rate.

    python -m experiments.router_comparison [--replicas 4 8] [--rate-per-replica 3]
        [--kv-cache-gb 4 16] [--bound] [--reuse]

Prints the table; writes ``router_comparison.csv``, ``.json`` and ``manifest.json``
to ``--out`` (``outputs/router_comparison``).
"""

from __future__ import annotations

import argparse
import json
import math
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from experiments.manifest import write_manifest
from policies.routers import ROUTERS
from testbed.build import load_requests, model_spec
from testbed.config_schema import compose_config
from testbed.core import Request
from testbed.core.kv_cache import block_hashes
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
BOUND = "one replica, the cluster's cache and compute"


def lru_hit_rate(requests: Sequence[Request], block_size: int, capacity: float) -> float:
    """Prompt tokens found in one LRU cache of ``capacity`` blocks, the prompts
    taken in arrival order, each caching its full blocks once it is served (hits
    counted as the KV-cache manager counts them: leading full blocks, never the
    last token)."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = queries = 0
    for req in requests:
        chain = list(block_hashes(req, block_size))
        hit = next((i for i, h in enumerate(chain) if h not in cache), len(chain))
        hits += hit * block_size
        queries += req.num_prompt_tokens
        for key in chain:
            cache[key] = None
            cache.move_to_end(key)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits / queries if queries else 0.0


def trace_reuse(overrides: list[str], kv_cache_gb: float) -> dict:
    """The LRU hit rates of the trace's prompts (those the model can take) for
    caches of 1, 4, 16 and 64 replicas' blocks and an unbounded one."""
    cfg = compose_config(overrides)
    spec = model_spec(cfg.model)
    _, requests = load_requests(cfg, spec)
    limit = cfg.engine.max_model_len or spec.max_position_embeddings
    fit = sorted((r for r in requests if r.num_prompt_tokens < limit), key=lambda r: r.arrival_time)
    bs = cfg.engine.block_size
    per_replica = int(kv_cache_gb * 1e9 // (bs * spec.kv_bytes_per_token(cfg.model.dtype)))
    rates = {f"{k}x": lru_hit_rate(fit, bs, k * per_replica) for k in (1, 4, 16, 64)}
    rates["unbounded"] = lru_hit_rate(fit, bs, math.inf)
    return dict(
        kv_cache_gb=kv_cache_gb, blocks_per_replica=per_replica, requests=len(fit), lru=rates
    )


def imbalance(steps_csv: Path) -> float:
    """The busiest replica's computed tokens over the mean replica's."""
    steps = pd.read_csv(steps_csv, usecols=["replica", "num_prefill_tokens", "num_decode_tokens"])
    per = (steps.num_prefill_tokens + steps.num_decode_tokens).groupby(steps.replica).sum()
    return float(per.max() / per.mean()) if len(per) and per.mean() > 0 else 1.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m experiments.router_comparison", description=__doc__
    )
    ap.add_argument("--replicas", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--routers", nargs="+", default=sorted(ROUTERS), choices=sorted(ROUTERS))
    ap.add_argument("--rate-per-replica", type=float, default=3.0)
    ap.add_argument("--prompt-scale", type=float, default=0.25)
    ap.add_argument(
        "--kv-cache-gb", type=float, nargs="+", default=[4.0],
        help="each replica's KV cache (a cache that holds every prefix makes routing moot)",
    )  # fmt: skip
    ap.add_argument("--bound", action="store_true", help="add the one-big-replica bound")
    ap.add_argument("--reuse", action="store_true", help="the trace's LRU hit rates")
    ap.add_argument("--trace", default="mooncake_conv")
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--out", type=Path, default=Path("outputs/router_comparison"))
    a = ap.parse_args(argv)
    rows, reuse = [], []
    for gb in a.kv_cache_gb:
        for n in a.replicas:
            common = [
                "mode=sim",
                f"model={a.model}",
                f"hardware={a.hardware}",
                f"trace={a.trace}",
                f"trace.prompt_scale={a.prompt_scale}",
                f"trace.rate={a.rate_per_replica * n}",
                "logging=disabled",
                "progress=false",
                "plots=false",
            ]
            runs = {
                router: [
                    f"cluster.num_replicas={n}",
                    f"cluster.router={router}",
                    f"engine.kv_cache_bytes={gb * 1e9}",
                ]
                for router in a.routers
            }
            if a.bound:
                base = compose_config(common).engine
                runs[BOUND] = [
                    f"engine.kv_cache_bytes={n * gb * 1e9}",
                    f"mode.latency_scale={1 / n}",
                    f"engine.max_num_seqs={n * base.max_num_seqs}",
                    f"engine.max_num_batched_tokens={n * base.max_num_batched_tokens}",
                ]
            group = []
            for router, overrides in runs.items():
                name = "bound" if router == BOUND else router
                run_dir = a.out / f"{gb:g}gb-{n}x-{name}"
                m = run_from_config(compose_config([*common, *overrides]), run_dir)
                row = dict(kv_cache_gb=gb, replicas=n, router=router)
                row |= {k: m[k] for k in METRICS}
                row["imbalance"] = imbalance(run_dir / "steps.csv")
                (run_dir / "steps.csv").unlink(missing_ok=True)  # tens of MB, not read again
                group.append(row)
                hit, ttft, p99, e2e = (row[k] for k in METRICS[:4])
                print(
                    f"{gb:g} GB {n} x {router:<26} hit {hit:.3f}  TTFT mean {ttft:.3f} "
                    f"p99 {p99:.3f}  E2E {e2e:.2f}  imbalance {row['imbalance']:.2f}",
                    flush=True,
                )
            bound = next((r for r in group if r["router"] == BOUND), None)
            for row in group:
                hit = row["prefix_cache_hit_rate"]
                row["of_bound"] = hit / bound["prefix_cache_hit_rate"] if bound else None
            rows += group
        if a.reuse:
            trace = [f"model={a.model}", f"trace={a.trace}", f"trace.prompt_scale={a.prompt_scale}"]
            reuse.append(trace_reuse(["mode=sim", *trace], gb))
            print(f"{gb:g} GB per replica, the trace's LRU hit rates: {reuse[-1]['lru']}")
    table = pd.DataFrame(rows)
    a.out.mkdir(parents=True, exist_ok=True)
    if reuse:
        (a.out / "trace_reuse.json").write_text(json.dumps(reuse, indent=2) + "\n")
    table.to_csv(a.out / "router_comparison.csv", index=False)
    (a.out / "router_comparison.json").write_text(json.dumps(rows, indent=2) + "\n")
    write_manifest(a.out)
    print(table.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
