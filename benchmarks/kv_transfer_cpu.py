"""The real engine's KV transfer on this machine: 1P1D (prefill and decode
worker processes, gloo), stories260K, requests one at a time with prompts of
several lengths; each transfer's time (the decode worker's receive posted to the
KV in its blocks) against its bytes, fitted as ``latency + bytes / bandwidth``
(what the simulator's link model takes), and the fit's error per length; and
each length's error against the committed ``cpu`` link preset (a held-out check
when the model is not the one the preset was fitted on: ``--model dummy-llama``,
3.2x stories260K's KV per token, prompts up to 2,000 tokens).

    python benchmarks/kv_transfer_cpu.py [--lengths 16 64 128 256 480] [--repeats 5]
    python benchmarks/kv_transfer_cpu.py --model dummy-llama --lengths 64 256 1000 2000 \
        --out benchmarks/results/kv_transfer_cpu_heldout.json
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
from testbed.sim.link import LinkSpec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 128, 256, 480])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--gap-s", type=float, default=0.3, help="between arrivals (one at a time)")
    ap.add_argument("--model", default="stories260K",
                    help="stories260K (its HF folder), or a config of conf/model/")  # fmt: skip
    ap.add_argument("--out", default="benchmarks/results/kv_transfer_cpu.json")
    a = ap.parse_args()
    model = a.model
    if a.model == "stories260K":
        folder = models_dir() / "stories260K" / "hf"
        if not (folder / "config.json").exists():
            raise SystemExit(f"stories260K not found at {folder} (set TESTBED_MODELS_DIR)")
        model = str(folder)
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
    args = EngineArgs(model=model, threads=1)
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
    preset = LinkSpec.preset("cpu")
    for r in rows:
        r["predicted_s"] = latency + r["bytes"] / bandwidth
        r["error"] = r["predicted_s"] / r["seconds_median"] - 1
        r["preset_s"] = preset.alone_s(r["bytes"])
        r["preset_error"] = r["preset_s"] / r["seconds_median"] - 1
        print(
            f"{r['prompt_tokens']:>5} tokens {r['bytes']:>9.0f} B  median "
            f"{r['seconds_median'] * 1e3:7.3f} ms (min {r['seconds_min'] * 1e3:.3f}, max "
            f"{r['seconds_max'] * 1e3:.3f})  fit {r['predicted_s'] * 1e3:7.3f} ms "
            f"({r['error']:+.0%})  cpu preset {r['preset_s'] * 1e3:7.3f} ms "
            f"({r['preset_error']:+.0%})"
        )
    print(f"fit: latency {latency * 1e3:.3f} ms, bandwidth {bandwidth / 1e6:.1f} MB/s")
    write_results(
        a.out,
        "kv_transfer_cpu",
        rows,
        model=a.model,
        latency_s=float(latency),
        bandwidth_bytes_s=float(bandwidth),
        transfers=len(secs),
        median_error=float(statistics.median(abs(r["error"]) for r in rows)),
        preset=dict(latency_s=preset.latency_s, bandwidth_bytes_s=preset.bandwidth_bytes_s),
        preset_max_error=float(max(abs(r["preset_error"]) for r in rows)),
    )


if __name__ == "__main__":
    main()
