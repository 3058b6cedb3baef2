"""The engine on a machine with one busy core, against the same engine quiet just
before and just after (one run).

The short offline workload of ``engine_throughput.py`` (48 requests, prompts
32-256, outputs 16-160, greedy, on the 8-layer dummy Llama) runs in rounds of
three: quiet, beside one other process spinning (``while True: pass``, left to
the OS to place, as any other job would be), quiet again. A round's ratio is the
busy run's output tokens per second over the mean of the two quiet runs around
it, so the machine's own drift between rounds cancels; the settings take turns,
a round each. Each setting's round runs in a process of its own (after a
warm-up pass over the workload), since OpenMP reads its environment
(``OMP_WAIT_POLICY``) once, when torch loads it:

- ``engine``: as a run of this project starts (``testbed/threads.py``: the wait
  policy and thread count it chooses);
- ``spinning``: OpenMP's own default (threads spin before they sleep), with the
  engine's thread count;
- ``one-thread``: the engine's choice on one thread: what losing a core costs.

    python benchmarks/busy_core.py [--settings engine spinning one-thread] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {  # name: (environment, engine options)
    "engine": ({}, {}),
    "spinning": ({"TESTBED_OMP_WAIT_POLICY": "openmp"}, {}),
    "one-thread": ({}, {"threads": 1}),
}
SPIN = "while True:\n    pass\n"


def child(rounds: int, setting: str) -> None:
    """One setting's rounds, in this process: a JSON line per round on stdout."""
    sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
    from testbed import threads

    threads.set_wait_policy()  # before torch loads OpenMP (engine_throughput imports it)
    from engine_throughput import SHORT_MODEL, WORKLOADS, run_ours, workload

    from testbed.engine.llm import LLM

    spec = WORKLOADS["short"]
    options = SETTINGS[setting][1]
    llm = LLM(SHORT_MODEL, max_num_seqs=64, max_num_batched_tokens=2048, **options)
    prompts, outputs = workload(
        spec["requests"], spec["prompt"], spec["output"], llm.config.vocab_size, 0
    )
    run_ours(llm, prompts, outputs)  # warm-up: the first pass over the workload runs slower
    tokens = sum(outputs)
    for _ in range(rounds):
        quiet1 = tokens / run_ours(llm, prompts, outputs)[0]
        spinner = subprocess.Popen([sys.executable, "-c", SPIN])
        try:
            time.sleep(0.5)  # the spinner under way
            busy = tokens / run_ours(llm, prompts, outputs)[0]
        finally:
            spinner.kill()
            spinner.wait()
        quiet2 = tokens / run_ours(llm, prompts, outputs)[0]
        row = dict(quiet_before=quiet1, busy=busy, quiet_after=quiet2, **threads.thread_settings())
        print(json.dumps(row), flush=True)


def run_setting(name: str, rounds: int) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}  # as a user's shell
    env |= SETTINGS[name][0]
    cmd = [sys.executable, __file__, "--child", name, "--rounds", str(rounds)]
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"setting {name}: {out.stderr[-2000:]}")
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    for row in rows:
        row["setting"] = name
        row["busy_over_quiet"] = row["busy"] / ((row["quiet_before"] + row["quiet_after"]) / 2)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="outputs/benchmarks/busy_core.json")
    parser.add_argument("--child", choices=list(SETTINGS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.rounds, args.child)
    sys.path.insert(0, str(ROOT))
    from common import write_results

    # Settings take turns, a round each, so that the machine's drift reaches all alike.
    rows = [
        row for _ in range(args.rounds) for name in args.settings for row in run_setting(name, 1)
    ]
    print(
        f"{'setting':11} {'threads':>7} {'wait policy':>11} {'quiet before':>12} "
        f"{'busy':>7} {'quiet after':>11} {'busy/quiet':>10}"
    )
    for r in rows:
        print(
            f"{r['setting']:11} {r['threads']:>7} {r['omp_wait_policy']:>11} "
            f"{r['quiet_before']:>12.1f} {r['busy']:>7.1f} {r['quiet_after']:>11.1f} "
            f"{r['busy_over_quiet']:>10.2f}"
        )
    for name in args.settings:
        ratios = [r["busy_over_quiet"] for r in rows if r["setting"] == name]
        quiet = [(r["quiet_before"] + r["quiet_after"]) / 2 for r in rows if r["setting"] == name]
        print(
            f"{name}: busy/quiet median {statistics.median(ratios):.2f} "
            f"({min(ratios):.2f}-{max(ratios):.2f}), quiet {statistics.median(quiet):.0f} tok/s"
        )
    write_results(args.out, "busy_core", rows, workload="short", rounds=args.rounds)


if __name__ == "__main__":
    main()
