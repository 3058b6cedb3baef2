"""The LM head on a CPU: one matrix product h·Wᵀ against the engine's W·hᵀ.

For each number of sampled rows, times the vocabulary projection of the
default model both ways (``torch.nn.functional.linear`` and ``CausalLM.logits``,
which takes W·hᵀ for up to ``cpu_wide_logits_rows`` rows on a CPU), and a whole
decode step of the engine's model with each (``--context`` cached tokens per
request). The two forms alternate round by round, so a drift of the machine
falls on both; the table gives the median of the rounds and the ratio.

    python benchmarks/lm_head.py --threads 1 2 --out benchmarks/results/lm_head_cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import write_results
from decode_step import step_time

from testbed.engine.device import pick_dtype
from testbed.engine.factory import engine_model
from testbed.engine.model import CausalLM
from testbed.engine.weights import build_model
from testbed.kernels import select_backend


def head_time(fn, hidden: torch.Tensor, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(hidden)
    return (time.perf_counter() - t0) / calls


def alternate(measure_plain, measure_wide, rounds: int) -> tuple[float, float]:
    """Median of ``rounds`` alternating measurements of the two forms."""
    plain, wide = [], []
    for _ in range(rounds):
        plain.append(measure_plain())
        wide.append(measure_wide())
    return statistics.median(plain), statistics.median(wide)


def with_rows_limit(model, limit: int, fn):
    """``fn`` with the model taking W·hᵀ for up to ``limit`` rows (0: never)."""

    def run():
        model.cpu_wide_logits_rows = limit
        return fn()

    return run


def measure(model, backend, n: int, args) -> dict:
    """The head and a whole decode step of ``n`` requests, each way."""
    w = model.lm_head.weight
    hidden = torch.randn(n, model.config.hidden_size)
    with torch.inference_mode():
        head_plain, head_wide = alternate(
            lambda: head_time(lambda h: torch.nn.functional.linear(h, w), hidden, args.calls),
            with_rows_limit(model, n, lambda: head_time(model.logits, hidden, args.calls)),
            args.rounds,
        )

    def step():
        return step_time(model, backend, n, args.context, 16, torch.device("cpu"), args.steps)[0]

    step_plain, step_wide = alternate(
        with_rows_limit(model, 0, step), with_rows_limit(model, n, step), args.rounds
    )
    del model.cpu_wide_logits_rows  # back to the engine's own limit
    return dict(
        head_plain_s=head_plain,
        head_wide_s=head_wide,
        step_plain_s=step_plain,
        step_wide_s=step_wide,
        engine_uses_wide=n <= CausalLM.cpu_wide_logits_rows,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="dummy-llama")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rows", type=int, nargs="+", default=list(range(1, 13)) + [16])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20, help="LM-head calls per round")
    ap.add_argument("--steps", type=int, default=5, help="decode steps per round")
    ap.add_argument("--out", default="benchmarks/results/lm_head_cpu.json")
    args = ap.parse_args()
    device = torch.device("cpu")
    cfg, _, name = engine_model(args.model)
    model = build_model(cfg, None, pick_dtype(None, device), device)
    backend = select_backend("auto", device)
    w = model.lm_head.weight
    rows = []
    print(f"{name}: LM head {tuple(w.shape)} {w.dtype}; decode steps at context {args.context}")
    print(
        f"{'threads':>7} {'rows':>4} {'h·Wᵀ ms':>9} {'W·hᵀ ms':>9} {'ratio':>6}"
        f" {'step ms':>9} {'step ms':>9} {'ratio':>6}"
    )
    for threads in args.threads:
        torch.set_num_threads(threads)
        for n in args.rows:
            row = measure(model, backend, n, args)
            rows.append(dict(model=name, threads=threads, rows=n, **row))
            print(
                f"{threads:>7} {n:>4} {row['head_plain_s'] * 1e3:>9.2f}"
                f" {row['head_wide_s'] * 1e3:>9.2f}"
                f" {row['head_plain_s'] / row['head_wide_s']:>6.2f}"
                f" {row['step_plain_s'] * 1e3:>9.2f} {row['step_wide_s'] * 1e3:>9.2f}"
                f" {row['step_plain_s'] / row['step_wide_s']:>6.2f}"
            )
    write_results(
        args.out,
        "lm_head",
        rows,
        context=args.context,
        rounds=args.rounds,
        engine_wide_rows=CausalLM.cpu_wide_logits_rows,
        torch=torch.__version__,
    )


if __name__ == "__main__":
    main()
