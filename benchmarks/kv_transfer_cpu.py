"""The real engine's KV transfer on this machine: 1P1D (prefill and decode
worker processes, gloo), stories260K, requests one at a time with prompts of
several lengths; each transfer's time (the decode worker's receive posted to the
KV in its blocks) against its bytes, fitted as ``latency + bytes / bandwidth``
(what the simulator's link model takes), and the fit's error per length.

    python benchmarks/kv_transfer_cpu.py [--lengths 16 64 128 256 480] [--repeats 5]
"""

from __future__ import annotations

import argparse
import random
import statistics

import numpy as np
from common import write_results

from policies.routers import make_router
from testbed.core import Request, SamplingParams
from testbed.engine.args import EngineArgs
from testbed.engine.cluster import replay_cluster
from testbed.models import models_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 128, 256, 480])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--gap-s", type=float, default=0.3, help="between arrivals (one at a time)")
    ap.add_argument("--out", default="benchmarks/results/kv_transfer_cpu.json")
    a = ap.parse_args()
    folder = models_dir() / "stories260K" / "hf"
    if not (folder / "config.json").exists():
        raise SystemExit(f"stories260K not found at {folder} (set TESTBED_MODELS_DIR)")
    rng = random.Random(5)
    reqs = []
    for _ in range(a.repeats):
        for n in a.lengths:
            reqs.append(
                Request(
                    f"r{len(reqs)}",
                    prompt_token_ids=[1] + [rng.randrange(3, 500) for _ in range(n - 1)],
                    sampling_params=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                    arrival_time=len(reqs) * a.gap_s,
                )
            )
    args = EngineArgs(model=str(folder), threads=1)
    result = replay_cluster(args, reqs, 2, make_router("round_robin"), num_prefill=1)
    if result.partial:
        raise SystemExit(f"the run stopped early: {result.stop_reason}")
    nbytes = np.array([r.kv_transfer_bytes for r in result.requests], dtype=float)
    secs = np.array([r.kv_transfer_end - r.kv_transfer_start for r in result.requests])
    # Least squares on medians per length: a latency and a time per byte.
    rows = []
    for n in a.lengths:
        pick = [i for i, r in enumerate(reqs) if len(r.prompt_token_ids) == n]
        rows.append(
            dict(
                prompt_tokens=n,
                bytes=float(np.median(nbytes[pick])),
                seconds_median=float(np.median(secs[pick])),
                seconds_min=float(secs[pick].min()),
                seconds_max=float(secs[pick].max()),
            )
        )
    x = np.array([r["bytes"] for r in rows])
    y = np.array([r["seconds_median"] for r in rows])
    slope, latency = np.polyfit(x, y, 1)
    bandwidth = 1 / slope if slope > 0 else float("inf")
    for r in rows:
        r["predicted_s"] = latency + r["bytes"] / bandwidth
        r["error"] = r["predicted_s"] / r["seconds_median"] - 1
        print(
            f"{r['prompt_tokens']:>5} tokens {r['bytes']:>9.0f} B  median "
            f"{r['seconds_median'] * 1e3:7.3f} ms (min {r['seconds_min'] * 1e3:.3f}, max "
            f"{r['seconds_max'] * 1e3:.3f})  fit {r['predicted_s'] * 1e3:7.3f} ms "
            f"({r['error']:+.0%})"
        )
    print(f"fit: latency {latency * 1e3:.3f} ms, bandwidth {bandwidth / 1e6:.1f} MB/s")
    write_results(
        a.out,
        "kv_transfer_cpu",
        rows,
        latency_s=float(latency),
        bandwidth_bytes_s=float(bandwidth),
        transfers=len(secs),
        median_error=float(statistics.median(abs(r["error"]) for r in rows)),
    )


if __name__ == "__main__":
    main()
