"""Policies compared on the Azure 2023 conv trace at three loads (simulated).

Llama-3-8B on an H200 (configs `model=llama3-8b hardware=h200`), the whole
trace with its arrivals rescaled to three loads, fractions of the capacity the
simulator finds for it (`testbed/capacity.py`, as `python run.py load=...`):
light (0.2), near saturation (0.8) and overload (1.2); `--rates` gives rates
instead. Prints mean / p99 TTFT and E2E per policy and load, writes JSON, and
checks the direction of each result against what the literature reports:

* SJF and SRPT lower mean latency against FCFS once requests queue (Fu et al.,
  "Efficient LLM Scheduling by Learning to Rank", NeurIPS 2024; Qiu et al. 2024;
  shortest-job scheduling theory), at the price of the longest jobs' tails.
* MLFQ (FastServe, 2023) lowers mean latency against FCFS without knowing
  output lengths, by demoting long jobs.
* At light load, policies barely differ: there is no queue to reorder.

What it found is in docs/policies.md ("How the bundled policies compare").

    python benchmarks/policy_comparison.py [--loads 0.2 0.8 1.2 | --rates 4 14 17]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common import write_results

from testbed.build import model_spec
from testbed.capacity import find_capacity
from testbed.config_schema import compose_config
from testbed.metrics.summary import summarize
from testbed.modes.sim import simulate
from testbed.workload import to_requests
from traces import load_trace

ROOT = Path(__file__).resolve().parent.parent

POLICIES = ["fcfs", "sjf", "srpt", "mlfq", "priority", "edf", "vtc", "cache_aware_sjf"]
BASE = [
    "trace=azure_conv",
    "model=llama3-8b",
    "hardware=h200",
    "logging=disabled",
    "progress=false",
    "plots=false",
]


def config(*overrides: str):
    return compose_config([*BASE, *overrides])


def capacity(num_requests: int) -> float:
    """The highest rate the engine sustains on the trace (as ``load=`` finds it)."""
    cfg = config(*([f"trace.num_requests={num_requests}"] if num_requests else []))
    return find_capacity(cfg)


def run(policy: str, rate: float, num_requests: int) -> dict:
    cfg = config(f"policy={policy}")
    opts = {"rate": rate} | ({"num_requests": num_requests} if num_requests else {})
    requests = to_requests(load_trace("azure_conv", **opts), seed=cfg.seed)
    result, extra = simulate(cfg, requests, model_spec(cfg.model))
    m = summarize(result)
    return dict(
        policy=policy,
        rate=rate,
        sim_wall_s=extra["sim_wall_s"],
        **{
            k: m[k]
            for k in (
                "ttft_s_mean",
                "ttft_s_p99",
                "e2e_s_mean",
                "e2e_s_p99",
                "throughput_req_s",
                "num_preemptions",
            )
        },
    )


def checks(rows: list[dict], rates: list[float]) -> list[tuple[str, bool]]:
    at = {(r["policy"], r["rate"]): r for r in rows}
    light, mid, heavy = rates
    out = []
    for rate in (mid, heavy):
        f = at[("fcfs", rate)]
        for p in ("sjf", "srpt", "mlfq"):
            out.append(
                (
                    f"{p} mean E2E < fcfs at {rate} req/s",
                    at[(p, rate)]["e2e_s_mean"] < f["e2e_s_mean"],
                )
            )
        out.append(
            (
                f"sjf mean TTFT < fcfs at {rate} req/s",
                at[("sjf", rate)]["ttft_s_mean"] < f["ttft_s_mean"],
            )
        )
    spread = [at[(p, light)]["e2e_s_mean"] for p in POLICIES]
    out.append(
        (
            f"policies within 10% of each other at {light} req/s (mean E2E)",
            max(spread) <= 1.1 * min(spread),
        )
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--loads", type=float, nargs=3, default=[0.2, 0.8, 1.2])
    ap.add_argument("--rates", type=float, nargs=3, help="rates (req/s) instead of loads")
    ap.add_argument("--num-requests", type=int, default=0, help="0: the whole trace")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/policy_comparison.json"))
    args = ap.parse_args()
    cap = None
    if args.rates is None:
        cap = capacity(args.num_requests)
        args.rates = [round(load * cap, 3) for load in args.loads]
        print(f"capacity {cap:.4g} req/s; loads {args.loads} -> rates {args.rates}")
    rows = [run(p, rate, args.num_requests) for rate in args.rates for p in POLICIES]
    print(
        f"{'rate':>5} {'policy':>16} {'TTFT mean':>10} {'TTFT p99':>9} {'E2E mean':>9} "
        f"{'E2E p99':>8} {'req/s':>6} {'preempt':>8}"
    )
    for r in rows:
        print(
            f"{r['rate']:>5} {r['policy']:>16} {r['ttft_s_mean']:>10.3f} {r['ttft_s_p99']:>9.3f}"
            f" {r['e2e_s_mean']:>9.2f} {r['e2e_s_p99']:>8.2f} {r['throughput_req_s']:>6.2f}"
            f" {r['num_preemptions']:>8}"
        )
    verdicts = checks(rows, args.rates)
    for text, ok in verdicts:
        print(f"  [{'ok' if ok else 'DIFFERS'}] {text}")
    write_results(
        args.out,
        "policy_comparison",
        rows,
        base=BASE,
        rates=args.rates,
        capacity_req_s=cap,
        loads=args.loads if cap is not None else None,
        num_requests=args.num_requests or "all",
        checks=[dict(check=t, holds=ok) for t, ok in verdicts],
    )


if __name__ == "__main__":
    main()
