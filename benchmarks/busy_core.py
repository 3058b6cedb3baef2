"""The engine on a machine with one busy core, against the same engine quiet just
before and just after (one run).

Two workloads on the 8-layer dummy Llama, greedy: ``short``, the short offline
workload of ``engine_throughput.py`` (48 requests, prompts 32-256, outputs
16-160, up to 64 at a time), and ``small-batch``, its first 16 requests two at a
time (the decode steps of a lightly loaded server, a few milliseconds each).
Each runs in rounds of three: quiet, beside one other process spinning
(``while True: pass``, left to the OS to place, as any other job would be),
quiet again. A round's ratio is the
busy run's output tokens per second over the mean of the two quiet runs around
it, so the machine's own drift between rounds cancels; the settings take turns,
a round each. Each setting's round runs in a process of its own (after a
warm-up pass over the workload), since OpenMP reads its environment
(``OMP_WAIT_POLICY``) once, when torch loads it:

- ``engine``: as a run of this project runs (``testbed/threads.py``: one thread
  per core that other processes leave free, OpenMP's default wait policy);
- ``fixed``: one thread per core throughout, as before the governor;
- ``passive``: one thread per core throughout, with ``OMP_WAIT_POLICY=PASSIVE``
  (threads sleep at once at every barrier, instead of spinning a while);
- ``one-thread``: one thread throughout: what losing a core costs.

    python benchmarks/busy_core.py [--settings engine fixed passive one-thread] [--rounds 2]
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
SETTINGS = {  # name: (environment, engine threads: None governed, "all" one per core)
    "engine": ({}, None),
    "fixed": ({}, "all"),
    "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, "all"),
    "one-thread": ({}, 1),
}
SPIN = "while True:\n    pass\n"


BATCHES = {"short": 64, "small-batch": 2}  # workload: max_num_seqs
SMALL_BATCH_REQUESTS = 16  # the short workload's first, two at a time


def child(rounds: int, setting: str) -> None:
    """One setting's rounds, in this process: a JSON line per workload and round."""
    sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
    from engine_throughput import SHORT_MODEL, WORKLOADS, run_ours, workload

    from testbed.engine.llm import LLM
    from testbed.threads import default_threads, thread_settings

    spec = WORKLOADS["short"]
    threads = SETTINGS[setting][1]
    threads = default_threads() if threads == "all" else threads
    for name, batch in BATCHES.items():
        llm = LLM(SHORT_MODEL, max_num_seqs=batch, max_num_batched_tokens=2048, threads=threads)
        prompts, outputs = workload(
            spec["requests"], spec["prompt"], spec["output"], llm.config.vocab_size, 0
        )
        if name == "small-batch":
            prompts, outputs = prompts[:SMALL_BATCH_REQUESTS], outputs[:SMALL_BATCH_REQUESTS]
        run_ours(llm, prompts, outputs)  # warm-up: the first pass runs slower
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
            row = dict(workload=name, quiet_before=quiet1, busy=busy, quiet_after=quiet2)
            print(json.dumps(row | thread_settings(llm.executor.threads)), flush=True)


def run_setting(name: str, rounds: int) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | SETTINGS[name][0]
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
        f"{'setting':11} {'workload':11} {'threads':>7} {'fewest':>6} {'wait policy':>14} "
        f"{'quiet before':>12} {'busy':>7} {'quiet after':>11} {'busy/quiet':>10}"
    )
    for r in rows:
        print(
            f"{r['setting']:11} {r['workload']:11} {r['threads']:>7} "
            f"{r.get('threads_fewest', '-'):>6} {r['omp_wait_policy']:>14} "
            f"{r['quiet_before']:>12.1f} {r['busy']:>7.1f} {r['quiet_after']:>11.1f} "
            f"{r['busy_over_quiet']:>10.2f}"
        )
    for workload in BATCHES:
        for name in args.settings:
            mine = [r for r in rows if r["setting"] == name and r["workload"] == workload]
            ratios = [r["busy_over_quiet"] for r in mine]
            quiet = [(r["quiet_before"] + r["quiet_after"]) / 2 for r in mine]
            busy = [r["busy"] for r in mine]
            print(
                f"{workload} {name}: busy/quiet median {statistics.median(ratios):.2f} "
                f"({min(ratios):.2f}-{max(ratios):.2f}); quiet {statistics.median(quiet):.0f}, "
                f"busy {statistics.median(busy):.0f} tok/s"
            )
    write_results(args.out, "busy_core", rows, rounds=args.rounds)


if __name__ == "__main__":
    main()
