"""The noise floor under the step-kind targets: how far this machine's speed moves
one kind of step against another over a few minutes.

A burst replay's packed-prefill steps (45 prompts, 2,047 tokens, beside 55
decodes) and its big decode steps (100 decodes after 130 tokens) are timed in
alternation on the real engine (dummy-llama, the CPU attention path, one
thread, as ``hardware=cpu1`` runs), each round a median of a few steps, for
``--seconds``. A latency model fitted once prices their ratio once; where the
measured ratio moves by more than the target between rounds a few seconds
apart, a replay that holds three packed steps cannot show the target.

    python benchmarks/step_kind_noise.py [--seconds 180] \\
        [--out benchmarks/results/step_kind_noise.json]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import write_results

from testbed.engine.llm import LLM
from testbed.profiling.grid import Point
from testbed.profiling.measure import measure_point

PACKED = Point(decode_batch=55, context=130, prefill_tokens=2047, prefills=45)
DECODE = Point(decode_batch=100, context=130, prefill_tokens=0)


def spread(values: list[float]) -> dict:
    return dict(
        median=statistics.median(values),
        min=min(values),
        max=max(values),
        cv=statistics.pstdev(values) / statistics.mean(values),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=180)
    ap.add_argument("--out", default="benchmarks/results/step_kind_noise.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    llm = LLM(
        "dummy-llama",
        num_kv_blocks=2048,
        attention_backend="cpu",
        device="cpu",
        max_num_seqs=256,
        max_num_batched_tokens=4096,
    )
    engine, executor, vocab = llm.engine, llm.executor, llm.config.vocab_size
    rows, start, k = [], time.time(), 0
    while time.time() - start < args.seconds:
        packed = measure_point(engine, executor, PACKED, 3, 1, vocab, k)["latency_s"]
        decode = measure_point(engine, executor, DECODE, 10, 2, vocab, k)["latency_s"]
        rows.append(dict(t_s=time.time() - start, packed_s=packed, decode_s=decode))
        rows[-1]["ratio"] = packed / decode
        k += 1
    summary = {key: spread([r[key] for r in rows]) for key in ("packed_s", "decode_s", "ratio")}
    minutes = {}
    for r in rows:
        minutes.setdefault(int(r["t_s"] // 60), []).append(r["ratio"])
    by_minute = [statistics.median(v) for _, v in sorted(minutes.items())]
    print(f"{len(rows)} rounds over {rows[-1]['t_s']:.0f} s, one thread")
    print(f"{'':22} {'median':>8} {'min':>8} {'max':>8} {'CV':>6}")
    for key, label, unit in (
        ("packed_s", "packed step (ms)", 1e3),
        ("decode_s", "decode step (ms)", 1e3),
        ("ratio", "packed / decode", 1),
    ):
        s = summary[key]
        print(
            f"{label:22} {s['median'] * unit:8.2f} {s['min'] * unit:8.2f} "
            f"{s['max'] * unit:8.2f} {s['cv']:6.1%}"
        )
    print("ratio by minute (median):", " ".join(f"{m:.2f}" for m in by_minute))
    write_results(
        args.out,
        "step_kind_noise",
        rows,
        threads=1,
        packed=PACKED.label(),
        decode=DECODE.label(),
        summary=summary,
        ratio_by_minute=by_minute,
    )


if __name__ == "__main__":
    main()
