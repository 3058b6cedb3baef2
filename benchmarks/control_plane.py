"""The control plane's own cost per engine step: ``schedule()`` + ``update_from_output()``.

Steady decode with N running requests (prefix caching on), no data plane: the
executor's answer is prepared outside the timed region. Reported per step and
per request, next to a floor measured in the same run: a bare Python loop that
does the least any scheduler must do per request and step (read its counts,
pick a token count, append a token and a timestamp). The ratio to that floor is
what the control plane's structure costs; the floor itself is CPython's.

    python benchmarks/control_plane.py [--steps 400] [--out benchmarks/results/control_plane.json]
"""

from __future__ import annotations

import argparse
import time
from array import array

from common import write_results

from policies import make_policy
from testbed.core import (
    ExecutorOutput,
    KVCacheManager,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)

PROMPT = 512
BLOCK = 16


def build(policy: str, n: int) -> Scheduler:
    steps_room = 4096
    blocks = n * ((PROMPT + steps_room) // BLOCK + 2)
    kv = KVCacheManager(blocks, BLOCK, enable_prefix_caching=True)
    cfg = SchedulerConfig(
        max_num_batched_tokens=max(8192, n), max_num_seqs=n, max_model_len=PROMPT + steps_room
    )
    sched = Scheduler(cfg, kv, make_policy(policy))
    for i in range(n):
        # A shared system prompt of 256 tokens, then a distinct part.
        prompt = list(range(256)) + [(i * 7919 + j) % 30000 for j in range(PROMPT - 256)]
        sched.add_request(
            Request(
                request_id=f"r{i}",
                prompt_token_ids=prompt,
                sampling_params=SamplingParams(max_tokens=steps_room - 8, ignore_eos=True),
                tenant=f"t{i % 4}",
            ),
            0.0,
        )
    t = 0.0
    while len(sched.running) < n or sched.waiting or _prefilling(sched):
        t += 0.01
        so = sched.schedule(t)
        sched.update_from_output(so, _tokens(so), t)
    return sched


def _prefilling(sched: Scheduler) -> bool:
    return any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running)


def _tokens(so) -> ExecutorOutput:
    return ExecutorOutput(sampled_token_ids=[[1]] * len(so.requests))


def time_steps(sched: Scheduler, steps: int) -> float:
    n = len(sched.running)
    outputs = ExecutorOutput(sampled_token_ids=[[1]] * n)
    t, total = 100.0, 0.0
    for _ in range(steps):
        t += 0.01
        start = time.perf_counter()
        so = sched.schedule(t)
        sched.update_from_output(so, outputs, t)
        total += time.perf_counter() - start
        assert len(so.requests) == n and so.num_decode_tokens == n, "not a steady decode step"
    return total / steps


def time_floor(n: int, steps: int) -> float:
    """The least work per request per step, in plain Python."""
    computed = [PROMPT] * n
    outputs = [[] for _ in range(n)]
    times = [array("d") for _ in range(n)]
    t, total = 100.0, 0.0
    for _ in range(steps):
        t += 0.01
        start = time.perf_counter()
        sched_n = []
        for i in range(n):
            k = PROMPT + len(outputs[i]) - computed[i] + 1
            computed[i] += k
            sched_n.append(k)
        for i in range(n):
            outputs[i].append(1)
            times[i].append(t)
        total += time.perf_counter() - start
    return total / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--out", default="benchmarks/results/control_plane.json")
    args = ap.parse_args()
    rows = []
    for n in (256, 1024):
        floor = time_floor(n, args.steps)
        for policy in ("fcfs", "vtc"):
            sched = build(policy, n)
            per_step = time_steps(sched, args.steps)
            rows.append(
                dict(
                    policy=policy,
                    running=n,
                    us_per_step=per_step * 1e6,
                    us_per_request=per_step * 1e6 / n,
                    floor_us_per_step=floor * 1e6,
                    ratio_to_floor=per_step / floor,
                )
            )
    print(
        f"{'policy':8} {'running':>8} {'us/step':>10} {'us/req':>8} {'floor us':>9} {'x floor':>8}"
    )
    for r in rows:
        print(
            f"{r['policy']:8} {r['running']:>8} {r['us_per_step']:>10.1f} "
            f"{r['us_per_request']:>8.2f} {r['floor_us_per_step']:>9.1f} "
            f"{r['ratio_to_floor']:>8.2f}"
        )
    write_results(args.out, "control_plane", rows, steps=args.steps, target_us_per_step_at_256=300)


if __name__ == "__main__":
    main()
