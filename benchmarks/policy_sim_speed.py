"""Simulator speed per policy: what a policy's waiting queue costs when it is long.

Every bundled policy simulates the full Azure 2023 conv trace (19,366
requests, real arrivals, 8 seeded tenants and 3 priority classes so that VTC
and priority have something to rank) in two set-ups: Llama-3-8B on an H200
(`model=llama3-8b hardware=h200`, the analytic model; the queue stays short)
and the default dummy model on this CPU (`model=dummy-llama hardware=cpu`, its
committed profile; the trace is far beyond that engine's capacity, so thousands
of requests wait and each step ranks them). The peer in the same run is the
same policy with its waiting-queue groups off (`Policy.group_of`: the queue
sorts every waiting request by ``key`` every step, as before groups existed),
for the policies that group; both must give the same metrics.

    python benchmarks/policy_sim_speed.py [--policies vtc mlfq] [--setups cpu]
        [--out benchmarks/results/policy_sim_speed.json]
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager
from pathlib import Path

from common import write_results
from omegaconf import OmegaConf
from sim_speed import measure

from policies import REGISTRY, make_policy
from testbed.build import model_spec, trace_options
from testbed.config_schema import compose_config
from testbed.core import scheduler
from testbed.core.queue import ResortedQueue, groups_its_queue
from traces import load_trace

ROOT = Path(__file__).resolve().parent.parent

SETUPS = {
    "h200": ["model=llama3-8b", "hardware=h200"],
    "cpu": ["model=dummy-llama", "hardware=cpu"],
}
COMMON = [
    "trace=azure_conv",
    "trace.num_tenants=8",
    "trace.priority_classes=3",
    "logging=disabled",
    "progress=false",
    "plots=false",
]


@contextmanager
def sorted_queues():
    """Schedulers whose waiting queue ignores the policy's groups: it sorts every
    waiting request by the key every step."""
    create = scheduler.create_waiting_queue
    scheduler.create_waiting_queue = ResortedQueue
    try:
        yield
    finally:
        scheduler.create_waiting_queue = create


def groups(policy: str) -> bool:
    return groups_its_queue(make_policy(policy))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policies", nargs="+", default=sorted(REGISTRY))
    ap.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/policy_sim_speed.json"))
    args = ap.parse_args()
    rows = []
    for setup in args.setups:
        base = compose_config([*SETUPS[setup], *COMMON])
        options = trace_options(OmegaConf.to_container(base.trace, resolve=True))
        trace = load_trace("azure_conv", **options)
        spec = model_spec(base.model)
        for policy in args.policies:
            cfg = compose_config([*SETUPS[setup], *COMMON, f"policy={policy}"])
            row = dict(setup=setup, policy=policy, **measure(cfg, trace, spec))
            if groups(policy):
                with sorted_queues():
                    peer = measure(cfg, trace, spec)
                row["sorted_sim_wall_s"] = peer["sim_wall_s"]
                row["speedup_over_sorted"] = peer["sim_wall_s"] / row["sim_wall_s"]
                row["same_metrics_as_sorted"] = all(
                    row[k] == peer[k] for k in ("finished", "steps", "mean_ttft_s", "mean_e2e_s")
                )
            rows.append(row)
            print(row, flush=True)
    print(
        f"\n{'setup':>5} {'policy':>16} {'max waiting':>11} {'sim wall s':>10} "
        f"{'req/wall-s':>10} {'sorted s':>9} {'speed-up':>8} {'same':>5}"
    )
    for r in rows:
        sorted_s = f"{r['sorted_sim_wall_s']:.2f}" if "sorted_sim_wall_s" in r else "-"
        speedup = f"{r['speedup_over_sorted']:.1f}x" if "speedup_over_sorted" in r else "-"
        same = str(r.get("same_metrics_as_sorted", "-"))
        print(
            f"{r['setup']:>5} {r['policy']:>16} {r['max_waiting']:>11} {r['sim_wall_s']:>10.2f} "
            f"{r['req_per_wall_s']:>10,.0f} {sorted_s:>9} {speedup:>8} {same:>5}"
        )
    write_results(args.out, "policy_sim_speed", rows, overrides=COMMON, setups=SETUPS)


if __name__ == "__main__":
    main()
