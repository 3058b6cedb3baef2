"""A step that prefills the same tokens as 1 to 64 prompts, with each attention path.

The step time should follow the tokens and the attention work, not the count of
sequences: the torch reference loops over the prompts (a gather and an attention
call per prompt per layer), the CPU path on torch alone (``cpu-torch``) packs them
into a few calls, and with its C++ kernel (``cpu``) runs them all in one. Each point
is measured as the profiler measures a grid point (the median of ``--repeats``
whole steps of exactly that composition, ``testbed.profiling.measure``), on a
dummy Llama of 8 layers, hidden 512 (``benchmarks/engine_throughput.py``'s
short-workload model) unless ``--model`` says otherwise.

    python benchmarks/packed_prefill.py [--tokens 2047] [--prompts 1 8 29 45 64]
"""

from __future__ import annotations

import argparse

import torch
from common import kernel_route, write_results
from engine_throughput import SHORT_MODEL

from testbed.engine.args import EngineArgs
from testbed.engine.factory import build_engine, engine_model
from testbed.profiling.grid import Point, fit_args
from testbed.profiling.measure import measure_point


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a conf/model name (default: the short model)")
    ap.add_argument("--tokens", type=int, default=2047)
    ap.add_argument("--prompts", type=int, nargs="+", default=[1, 8, 16, 29, 45, 64])
    ap.add_argument("--backends", nargs="+", default=["torch", "cpu-torch", "cpu"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/packed_prefill.json")
    args = ap.parse_args()
    model = engine_model(args.model or SHORT_MODEL)
    points = [Point(0, 0, args.tokens, 0, 0, k) for k in args.prompts]
    rows = []
    for backend in args.backends:
        engine_args = EngineArgs(
            model="packed", device="cpu", attention_backend=backend.removesuffix("-torch")
        )
        fit_args(engine_args, points, args.repeats, 2)
        engine, executor, cfg = build_engine(engine_args, model=model)
        executor.record_timings = True
        for i, point in enumerate(points):
            with kernel_route(backend):
                r = measure_point(engine, executor, point, args.repeats, 2, cfg.vocab_size, i)
            rows.append(
                dict(
                    backend=backend,
                    prompts=point.prefills,
                    tokens=point.prefill_tokens,
                    attn_pairs=r["attn_pairs"],
                    step_s=r["latency_s"],
                    attention_s=r["attention_s"],
                    threads=torch.get_num_threads(),
                )
            )
    print(f"{'backend':9} {'prompts':>7} {'tokens':>6} {'step ms':>8} {'attn ms':>8} {'vs 29':>6}")
    for r in rows:
        base = next((x for x in rows if x["backend"] == r["backend"] and x["prompts"] == 29), r)
        r["vs_29_prompts"] = r["step_s"] / base["step_s"]
        print(
            f"{r['backend']:9} {r['prompts']:>7} {r['tokens']:>6} {r['step_s'] * 1e3:>8.1f} "
            f"{r['attention_s'] * 1e3:>8.1f} {r['vs_29_prompts']:>6.2f}"
        )
    write_results(args.out, "packed_prefill", rows, model=model[2], repeats=args.repeats)


if __name__ == "__main__":
    main()
