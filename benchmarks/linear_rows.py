"""Linear layers for a few rows on a CPU: the C++ kernel (``cpu_linear_rows.cpp``)
against oneDNN's packed GEMM, both on the engine's packed model.

For each dtype and row count it times (a) the model's products in a step's order
(q/k/v, o, gate/up and down of every layer, then the LM head), each weight
streamed from memory as in a decode step, and (b) a whole decode step of that many
requests (``--context`` cached tokens each) through the engine's model. Each
measurement alternates the two routes round by round, so a drift of the machine
falls on both; the table gives medians and the ratio kernel / oneDNN.

    python benchmarks/linear_rows.py --out benchmarks/results/linear_rows.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import write_results
from decode_step import step_time
from engine_throughput import SHORT_MODEL

from testbed.engine import cpu_linear
from testbed.engine.llm import LLM
from testbed.host import usable_cores
from testbed.kernels import select_backend


def set_rows(layers: list[cpu_linear.PackedLinear], on: bool) -> None:
    """Every packed product takes up to ``ROWS`` rows in C++ (on) or none (off)."""
    for layer in layers:
        layer.max_rows = cpu_linear.ROWS[layer.packed.dtype] if on else 0


def products_time(layers, rows: int, dtype, calls: int) -> float:
    xs = {n: torch.randn(rows, n).to(dtype) for n in {layer.in_features for layer in layers}}
    with torch.inference_mode():
        for layer in layers:  # warm-up
            layer(xs[layer.in_features])
        t0 = time.perf_counter()
        for _ in range(calls):
            for layer in layers:
                layer(xs[layer.in_features])
    return (time.perf_counter() - t0) / calls


def alternate(measure, layers, rounds: int) -> tuple[float, float]:
    """Medians of ``rounds`` alternating measurements: oneDNN, then the kernel."""
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(rounds):
        for on in (False, True):
            set_rows(layers, on)
            times[on].append(measure())
    set_rows(layers, True)
    return statistics.median(times[False]), statistics.median(times[True])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=usable_cores())
    ap.add_argument("--out", default="benchmarks/results/linear_rows.json")
    args = ap.parse_args()
    rows_out = []
    print(
        f"{'dtype':>9} {'rows':>5} {'products oneDNN ms':>19} {'kernel ms':>10} {'ratio':>6}"
        f" {'step oneDNN ms':>15} {'kernel ms':>10} {'ratio':>6}"
    )
    for name in args.dtypes:
        dtype = getattr(torch, name)
        llm = LLM(SHORT_MODEL, dtype=name, seed=0, threads=args.threads)
        model = llm.executor.model
        layers = cpu_linear.packed_linears(model) + [model.packed_head]
        if layers[0].rows_packed is None:
            print(f"{name}: the kernel is not used here ({cpu_linear.route(model)})")
            continue
        cpu = torch.device("cpu")
        backend = select_backend("auto", cpu)
        mb = sum(layer.packed.numel() * layer.packed.element_size() for layer in layers) / 1e6
        for rows in args.rows:
            p_off, p_on = alternate(
                lambda: products_time(layers, rows, dtype, 10),  # noqa: B023 (called at once)
                layers,
                args.rounds,
            )
            s_off, s_on = alternate(
                lambda: step_time(model, backend, rows, args.context, 32, cpu, 5)[0],  # noqa: B023
                layers,
                args.rounds,
            )
            row = dict(
                dtype=name,
                rows=rows,
                threads=args.threads,
                weights_mb=round(mb, 1),
                products_onednn_ms=1e3 * p_off,
                products_kernel_ms=1e3 * p_on,
                products_ratio=p_on / p_off,
                products_kernel_gb_s=mb / 1e3 / p_on,
                step_onednn_ms=1e3 * s_off,
                step_kernel_ms=1e3 * s_on,
                step_ratio=s_on / s_off,
            )
            rows_out.append(row)
            print(
                f"{name:>9} {rows:5d} {1e3 * p_off:19.2f} {1e3 * p_on:10.2f} {p_on / p_off:6.2f}"
                f" {1e3 * s_off:15.2f} {1e3 * s_on:10.2f} {s_on / s_off:6.2f}"
            )
    write_results(
        args.out,
        "linear_rows",
        rows_out,
        model=SHORT_MODEL["name"],
        context=args.context,
        rounds=args.rounds,
        kernel_rows=({str(k).removeprefix("torch."): v for k, v in cpu_linear.ROWS.items()}),
    )


if __name__ == "__main__":
    main()
